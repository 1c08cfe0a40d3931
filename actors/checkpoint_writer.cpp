#include "actors/checkpoint_writer.hpp"

#include <signal.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <fstream>
#include <mutex>
#include <thread>

#include <caf/all.hpp>
#include <spdlog/spdlog.h>

#include "compute/checkpoint/checkpoint_dir.hpp"
#include "messages/type_ids.hpp"

namespace troupe {

namespace {

constexpr std::int64_t mib = 1 << 20;
std::atomic<std::int64_t> reserved{0};  // bytes of this process's snapshots in flight

// The background writes of this process that are running. Never destroyed: the detached
// writing (and fault) threads use it, also while the process ends.
struct writes_state {
  std::mutex mutex;
  std::condition_variable changed;
  int running = 0;
  int ended = 0;  // how many times await_checkpoint_writes returned (a run's end)
};
writes_state& writes() {
  static auto* w = new writes_state;
  return *w;
}

/// MemAvailable of /proc/meminfo in bytes, or -1.
std::int64_t available_memory() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  std::int64_t kb = 0;
  std::string unit;
  while (in >> key >> kb >> unit)
    if (key == "MemAvailable:") return kb * 1024;
  return -1;
}

std::string mib_text(std::int64_t bytes) { return std::to_string((bytes + mib - 1) / mib) + " MiB"; }

}  // namespace

stage_checkpoint write_files(const stage_files& files, trace_event event, const std::function<double()>& now_us) {
  stage_checkpoint out;
  event.name = "checkpoint write";
  event.start_us = now_us();
  try {
    const auto written = files.shard >= 0
                             ? std::vector<checkpoint_file>{write_shard_file(files.folder, files.stage, files.shard,
                                                                             files.params)}
                             : write_stage_files(files.folder, files.stage, files.params, files.optim);
    for (const auto& f : written) out.files.push_back({f.name, f.stage, f.kind, f.bytes, f.crc32});
  } catch (const std::exception& e) {
    out.error = e.what();
  }
  event.end_us = now_us();
  event.bytes = 0;
  for (const auto& f : out.files) event.bytes += std::int64_t(f.bytes);
  out.events.push_back(event);
  return out;
}

std::int64_t snapshot_bytes(const stage_files& files) {
  std::int64_t n = 0;
  for (const auto* dict : {&files.params, &files.optim})
    for (const auto& [name, t] : *dict) n += std::int64_t(t.numel() * t.element_size());
  return n;
}

std::string reserve_snapshot(std::int64_t bytes, int limit_mib) {
  if (limit_mib > 0) {
    const std::int64_t limit = std::int64_t(limit_mib) * mib;
    auto held = reserved.load();
    do {
      if (held + bytes > limit)
        return "the snapshot (" + mib_text(bytes) + ") and those of this node still being written (" +
               mib_text(held) + ") are over output.checkpoint_async_memory (" + std::to_string(limit_mib) + " MiB)";
    } while (!reserved.compare_exchange_weak(held, held + bytes));
    return "";
  }
  // The snapshots still being written already count against the available memory.
  const auto available = available_memory();
  if (available < 0) return "this host's available memory is unknown (no MemAvailable in /proc/meminfo)";
  if (bytes > available / 2)
    return "the snapshot (" + mib_text(bytes) + ") is over half of this host's available memory (" +
           mib_text(available) + "; output.checkpoint_async_memory sets the bound)";
  reserved += bytes;
  return "";
}

void release_snapshot(std::int64_t bytes) { reserved -= bytes; }

stage_files copy_snapshot(const stage_files& files) {
  // One copy each: a device tensor's copy to the host is already its own.
  const auto own = [](const torch::Tensor& t) { return t.device().is_cpu() ? t.clone() : t.to(torch::kCPU); };
  stage_files out{files.folder, files.stage, {}, {}, files.shard};
  for (const auto& [name, t] : files.params) out.params.emplace_back(name, own(t));
  for (const auto& [name, t] : files.optim) out.optim.emplace_back(name, own(t));
  return out;
}

caf::actor spawn_checkpoint_writer(caf::local_actor* parent, stage_files snapshot, std::int64_t bytes,
                                   trace_event event, std::function<double()> now_us,
                                   std::optional<double> kill_after, int node) {
  // Hidden: a node process that ends (a run that failed) does not wait for an answer nobody
  // will ask for; await_checkpoint_writes lets the write itself finish.
  auto writer = parent->system().spawn<caf::hidden>([](caf::event_based_actor* self) -> caf::behavior {
    struct written {
      std::optional<stage_checkpoint> out;
      std::vector<caf::response_promise> asked;
    };
    auto state = std::make_shared<written>();
    return {
        [=](stage_checkpoint& out) {  // from the writing thread
          state->out = std::move(out);
          for (auto& rp : state->asked) rp.deliver(*state->out);
          if (!state->asked.empty()) self->quit();
        },
        [=](durable_atom) -> caf::result<stage_checkpoint> {
          if (state->out) {
            self->quit();
            return *state->out;
          }
          state->asked.push_back(self->make_response_promise());
          return caf::delegated<stage_checkpoint>();
        },
        caf::after(std::chrono::seconds(3600)) >> [=] {  // written, and nobody asked (the run ended)
          if (state->out) self->quit();
        },
    };
  });
  int run = 0;
  {
    std::lock_guard<std::mutex> lock(writes().mutex);
    ++writes().running;
    run = writes().ended;
  }
  const auto step = event.step + 1;
  if (kill_after)
    std::thread([seconds = *kill_after, node, step, run] {
      {  // not once the run has ended (its writes done): the process is then on its way out
        auto& w = writes();
        std::unique_lock<std::mutex> lock(w.mutex);
        if (w.changed.wait_for(lock, std::chrono::duration<double>(seconds), [&] { return w.ended != run; })) return;
      }
      static std::atomic_flag killing = ATOMIC_FLAG_INIT;
      if (killing.test_and_set()) return;
      spdlog::warn("fault injected: node {} kills its own process (SIGKILL) {:.3f} s into its background write of "
                   "step {}'s checkpoint",
                   node, seconds, step);
      spdlog::default_logger()->flush();
      ::kill(::getpid(), SIGKILL);
    }).detach();
  // The write: on a thread of its own at the lowest priority, so that the training threads
  // keep the cores (the writer mostly waits for the disk).
  std::thread([snapshot = std::move(snapshot), bytes, event, now_us, writer]() mutable {
    ::setpriority(PRIO_PROCESS, id_t(::syscall(SYS_gettid)), 19);
    auto out = write_files(snapshot, event, now_us);
    snapshot = {};  // the host memory back before the bound is
    release_snapshot(bytes);
    caf::anon_send(writer, std::move(out));
    auto& w = writes();
    std::lock_guard<std::mutex> lock(w.mutex);
    --w.running;
    w.changed.notify_all();
  }).detach();
  return writer;
}

void await_checkpoint_writes(double seconds) {
  auto& w = writes();
  std::unique_lock<std::mutex> lock(w.mutex);
  w.changed.wait_for(lock, std::chrono::duration<double>(seconds), [&] { return w.running == 0; });
  ++w.ended;
  w.changed.notify_all();
}

}  // namespace troupe
