// LibTorch's intra-op threads belong to the stage actors: a thread of the transport or of
// an actor system's scheduler computes on one, even after a stage actor raised the
// process-wide count (a second OpenMP team makes libgomp stop spin-waiting).
#include <gtest/gtest.h>

#include <condition_variable>
#include <mutex>
#include <thread>

#include <ATen/Parallel.h>
#include <caf/all.hpp>

#include "actors/intra_op_threads.hpp"
#include "transport/torch_threads.hpp"

namespace troupe {
namespace {

/// Puts the calling thread's (and the process-wide) intra-op count back at the end.
struct restore_threads {
  int n = at::get_num_threads();
  ~restore_threads() { at::set_num_threads(n); }
};

}  // namespace

// A thread set to one that has run no parallel op yet keeps one when a stage actor then
// raises the process-wide count: LibTorch's lazy per-thread set-up ran first.
TEST(IntraOpThreads, AThreadSetToOneKeepsOneWhenTheProcessWideCountRises) {
  restore_threads restore;
  std::mutex m;
  std::condition_variable cv;
  int phase = 0;
  int seen = 0;
  std::thread other([&] {
    transport::compute_on_one_intra_op_thread();
    {
      std::unique_lock<std::mutex> lock(m);
      phase = 1;
      cv.notify_all();
      cv.wait(lock, [&] { return phase == 2; });
    }
    seen = at::get_num_threads();
  });
  {
    std::unique_lock<std::mutex> lock(m);
    cv.wait(lock, [&] { return phase == 1; });
    at::set_num_threads(3);  // as a stage actor does
    phase = 2;
    cv.notify_all();
  }
  other.join();
  EXPECT_EQ(seen, 1);
  EXPECT_EQ(at::get_num_threads(), 3);  // (the caller's own count is its own)
}

// An actor on the scheduler's threads computes on one, though the count was raised after
// the system started (the optimizer shard's in-process reduce-scatter runs there).
TEST(IntraOpThreads, SchedulerThreadsComputeOnOne) {
  restore_threads restore;
  caf::actor_system_config cfg;
  cfg.set("scheduler.policy", caf::atom("sharing"));
  cfg.set("scheduler.max-threads", std::size_t{2});
  cfg.add_thread_hook<one_intra_op_thread>();
  caf::actor_system sys{cfg};
  at::set_num_threads(2);
  auto counter = sys.spawn([]() -> caf::behavior {
    return {[](int) { return at::get_num_threads(); }};
  });
  caf::scoped_actor self{sys};
  for (int i = 0; i < 4; ++i)  // (either worker may run it)
    self->request(counter, std::chrono::seconds(10), i)
        .receive([](int n) { EXPECT_EQ(n, 1); }, [&](caf::error& e) { FAIL() << sys.render(e); });
  self->send_exit(counter, caf::exit_reason::user_shutdown);
}

}  // namespace troupe
