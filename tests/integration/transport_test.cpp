// transport/: the local backend in one process (threads), and the UCX backend over 2, 3
// and 4 processes on shared memory and on TCP, checked against the ring-order reference
// and c10d::ProcessGroupGloo by tests/integration/transport_peer.cpp.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <functional>
#include <optional>
#include <thread>

#include "launch/environment.hpp"
#include "compute/device.hpp"
#include "test_util.hpp"
#include "process_group.hpp"
#include "transport/host_staging.hpp"
#include "transport/local/local_group.hpp"
#include "transport/ucx/ucx_communicator.hpp"

using namespace troupe;
using namespace troupe::transport;

namespace {

std::vector<torch::Tensor> inputs(int n, std::int64_t size) {
  std::vector<torch::Tensor> all;
  for (int r = 0; r < n; ++r) all.push_back(torch::randn({size}));
  return all;
}

/// Runs f(rank) on one thread per rank.
template <class F>
void on_threads(int n, F f) {
  std::vector<std::thread> ts;
  std::vector<std::string> errors(n);
  for (int r = 0; r < n; ++r)
    ts.emplace_back([&, r] {
      try {
        f(r);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : ts) t.join();
  for (int r = 0; r < n; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

}  // namespace

TEST(Transport, PiecesCoverUnevenSizes) {
  for (std::int64_t n : {0, 1, 5, 7, 64})
    for (int parts : {1, 2, 3, 4}) {
      std::int64_t next = 0;
      for (int i = 0; i < parts; ++i) {
        auto [b, e] = piece(n, parts, i);
        EXPECT_EQ(b, next);
        EXPECT_LE(e - b, n / parts + 1);
        EXPECT_GE(e - b, n / parts);
        next = e;
      }
      EXPECT_EQ(next, n);
    }
}

TEST(Transport, LocalCollectivesEqualSumsInRingOrder) {
  for (int n : {1, 2, 3, 4})
    for (std::int64_t size : {1, 7, 1000}) {
      auto comms = make_local_group(n);
      auto all = inputs(n, size);
      auto plain = torch::stack(all).sum(0);
      std::vector<torch::Tensor> reduced(n), scattered(n), gathered(n), bcast(n);
      on_threads(n, [&](int r) {
        auto& c = *comms[r];
        reduced[r] = all[r].clone();
        c.all_reduce(reduced[r])->wait_or_throw(std::chrono::seconds(10));
        auto [b, e] = piece(size, n, r);
        scattered[r] = torch::empty({e - b});
        c.reduce_scatter(all[r], scattered[r])->wait_or_throw(std::chrono::seconds(10));
        gathered[r] = torch::empty({size});
        c.all_gather(all[r].narrow(0, b, e - b).clone(), gathered[r])->wait_or_throw(std::chrono::seconds(10));
        bcast[r] = r == 0 ? all[0].clone() : torch::zeros({size});
        c.broadcast(bcast[r], 0)->wait_or_throw(std::chrono::seconds(10));
      });
      for (int r = 0; r < n; ++r) {
        EXPECT_TRUE(torch::allclose(reduced[r], plain, 1e-5, 1e-5));
        auto [b, e] = piece(size, n, r);
        EXPECT_TRUE(torch::equal(scattered[r], reduced[0].narrow(0, b, e - b)));
        EXPECT_TRUE(torch::equal(gathered[r].narrow(0, b, e - b), all[r].narrow(0, b, e - b)));
        EXPECT_TRUE(torch::equal(bcast[r], all[0]));
        EXPECT_TRUE(torch::equal(reduced[r], reduced[0]));
      }
      // The fixed order, checked on piece 0 with 3 ranks: ((x1 + x2) + x0).
      if (n == 3) {
        auto [b, e] = piece(size, n, 0);
        auto want = (all[1].narrow(0, b, e - b) + all[2].narrow(0, b, e - b)) + all[0].narrow(0, b, e - b);
        EXPECT_TRUE(torch::equal(scattered[0], want));
      }
    }
}

TEST(Transport, LocalMismatchAndAbortAreErrors) {
  auto comms = make_local_group(2);
  auto a = torch::ones({4}), b = torch::ones({4});
  auto w0 = comms[0]->all_reduce(a);
  auto w1 = comms[1]->broadcast(b, 0);
  EXPECT_THROW(w0->wait(std::chrono::seconds(1)), transport_error);
  EXPECT_THROW(w1->wait(std::chrono::seconds(1)), transport_error);
  try {
    w0->wait(std::chrono::seconds(1));
  } catch (const transport_error& e) {
    EXPECT_NE(std::string(e.what()).find("collective order mismatch"), std::string::npos) << e.what();
  }
  // A pending collective fails on abort (a peer died) instead of waiting for ever.
  auto w = comms[0]->all_reduce(a);
  EXPECT_FALSE(w->wait(std::chrono::milliseconds(50)));
  comms[1]->abort("rank 1 died");
  EXPECT_THROW(w->wait(std::chrono::seconds(1)), transport_error);
  EXPECT_NE(w->error().find("rank 1 died"), std::string::npos);
  EXPECT_THROW(comms[0]->all_reduce(a)->wait(std::chrono::seconds(1)), transport_error);
}

// The UCX progress loop sleeps at once where UCX_TLS allows TCP only and the machine has
// fewer cores than ranks on it, spins otherwise; TROUPE_UCX_SPIN or an explicit option
// wins. (launch/ reads both variables once: troupe_cli::ucx_options_from.)
TEST(Transport, UcxSpinFollowsTheTransports) {
  const std::vector<std::pair<std::string, int>> cases{
      {"tcp", 0}, {"tcp,self", 0}, {"self,tcp", 0}, {"sm,self", 2000}, {"tcp,sm,self", 2000},
      {"rc,tcp", 2000}, {"^sm", 2000}, {"all", 2000}};
  const int crowded = int(std::thread::hardware_concurrency()) + 1;
  for (const auto& [value, want] : cases) {
    const auto o = troupe_cli::ucx_options_from(nullptr, value.c_str());
    EXPECT_EQ(o.tls, value);
    EXPECT_EQ(resolve_spin(o.spin, crowded, o.tls), want) << value;
    EXPECT_EQ(resolve_spin(o.spin, 1, o.tls), 2000) << value << ": a core per rank";
  }
  EXPECT_EQ(resolve_spin(-1), 2000);
  EXPECT_EQ(resolve_spin(7, crowded, "tcp"), 7);
  const auto spin = troupe_cli::ucx_options_from("300", "tcp");
  EXPECT_EQ(resolve_spin(spin.spin, crowded, spin.tls), 300);
  EXPECT_THROW(troupe_cli::ucx_options_from("many", nullptr), troupe::config_error);
  EXPECT_THROW(troupe_cli::ucx_options_from("3x", nullptr), troupe::config_error);
}

TEST(Transport, LocalSendRecvAndCompletionCallbacks) {
  auto comms = make_local_group(2);
  auto out = torch::arange(10, torch::kFloat32), in = torch::empty({10});
  std::string seen = "not called";
  auto r = comms[1]->recv(in, 0, 3);
  r->on_complete([&](const std::string& err) { seen = err; });
  EXPECT_FALSE(r->done());
  comms[0]->send(out, 1, 3)->wait_or_throw(std::chrono::seconds(1));
  EXPECT_TRUE(r->done());
  EXPECT_EQ(seen, "");
  EXPECT_TRUE(torch::equal(in, out));
  auto short_in = torch::empty({3});
  auto r2 = comms[1]->recv(short_in, 0, 4);
  comms[0]->send(out, 1, 4);
  EXPECT_THROW(r2->wait(std::chrono::seconds(1)), transport_error);
  EXPECT_THROW(comms[0]->all_reduce(torch::ones({2, 2}).t()), std::invalid_argument);  // not contiguous
}

namespace {

/// Every operation through staged communicators (`stage` over the in-process backend, its
/// backend() naming `says`) on tensors of `device`: the results are the unstaged backend's
/// bit for bit, written into the caller's tensors (on `device`), inputs untouched; an
/// all-gather in place too.
void check_staged_operations(torch::Device device,
                             const std::function<std::shared_ptr<communicator>(std::shared_ptr<communicator>)>& stage,
                             const std::string& says) {
  const auto wait = [](const work_ptr& w) { w->wait_or_throw(std::chrono::seconds(10)); };
  for (int n : {2, 3})
    for (std::int64_t size : {1, 7, 1000}) {
      auto plain = make_local_group(n), inner = make_local_group(n);
      std::vector<std::shared_ptr<communicator>> staged;
      for (auto& c : inner) staged.push_back(stage(c));
      EXPECT_NE(staged[0]->backend().find(says), std::string::npos) << staged[0]->backend();
      auto all = inputs(n, size);
      // [0]: plain on the CPU, [1]: staged on `device`
      std::vector<std::vector<torch::Tensor>> reduced(2, std::vector<torch::Tensor>(n)), scattered = reduced,
                                               gathered = reduced, in_place = reduced, bcast = reduced,
                                               received = reduced;
      std::vector<torch::Tensor> staged_inputs(n);
      for (int run = 0; run < 2; ++run) {
        const auto dev = run == 0 ? torch::Device(torch::kCPU) : device;
        auto& comms = run == 0 ? plain : staged;
        on_threads(n, [&](int r) {
          auto& c = *comms[r];
          const auto x = all[r].to(dev);
          if (run == 1) staged_inputs[r] = x;
          auto [b, e] = piece(size, n, r);
          reduced[run][r] = x.clone();
          wait(c.all_reduce(reduced[run][r]));
          scattered[run][r] = torch::full({e - b}, -1.0f, x.options());
          wait(c.reduce_scatter(x, scattered[run][r]));
          gathered[run][r] = torch::empty({size}, x.options());
          wait(c.all_gather(x.narrow(0, b, e - b).clone(), gathered[run][r]));
          in_place[run][r] = x.clone();  // this rank's piece is already in place
          wait(c.all_gather(in_place[run][r].narrow(0, b, e - b), in_place[run][r]));
          bcast[run][r] = r == 1 ? x.clone() : torch::zeros({size}, x.options());
          wait(c.broadcast(bcast[run][r], 1));
          // A ring of sends: rank r to r + 1.
          received[run][r] = torch::empty({size}, x.options());
          auto rw = c.recv(received[run][r], (r + n - 1) % n, 7);
          wait(c.send(x, (r + 1) % n, 7));
          wait(rw);
        });
      }
      for (int r = 0; r < n; ++r) {
        for (const auto* t : {&reduced, &scattered, &gathered, &in_place, &bcast, &received}) {
          EXPECT_EQ((*t)[1][r].device(), device);
          EXPECT_TRUE(torch::equal((*t)[1][r].cpu(), (*t)[0][r])) << "n " << n << " size " << size << " rank " << r;
        }
        EXPECT_TRUE(torch::equal(staged_inputs[r].cpu(), all[r]));
      }
    }
}

std::vector<test::process_group::result> run_peers(const std::string& mode, int n, const std::string& tls,
                                                   const test::temp_dir& dir, std::chrono::seconds deadline) {
  test::process_group group(
      n,
      [&](int r) {
        return std::vector<std::string>{TROUPE_TRANSPORT_PEER, mode, std::to_string(r), std::to_string(n),
                                        dir.path.string()};
      },
      {"UCX_TLS=" + tls, "OMP_NUM_THREADS=1"}, dir.path.string());
  return group.wait(deadline);
}

std::string transports_of(const std::string& name) { return name == "shm" ? "sm,self" : "tcp,self"; }

}  // namespace

// The host staging path (what GPU tensors take over UCX between nodes) on the CPU, where
// `always` stages host tensors too.
TEST(HostStaging, EveryOperationEqualsTheUnstagedBackend) {
  check_staged_operations(torch::kCPU, [](auto c) { return stage_through_host(c, true); }, "staged through host memory");
}

TEST(HostStaging, CudaTensorsGiveTheCpuResultsOnTheGpu) {
  if (!cuda_usable()) GTEST_SKIP() << "no usable GPU (or a LibTorch without CUDA)";
  check_staged_operations(
      torch::Device(torch::kCUDA, 0), [](auto c) { return stage_through_host(c, false); }, "staged through host memory");
}

// The other way round (what the nodes put in front of NCCL): host tensors through copies
// on the GPU give the same results, back in host memory. A GPU must be named by index.
TEST(DeviceStaging, HostTensorsThroughTheGpuGiveTheSameResults) {
  EXPECT_THROW(stage_through_device(make_local_group(1)[0], torch::Device(torch::kCUDA)), std::invalid_argument);
  if (!cuda_usable()) GTEST_SKIP() << "no usable GPU (or a LibTorch without CUDA)";
  const torch::Device gpu(torch::kCUDA, 0);
  check_staged_operations(torch::kCPU, [&](auto c) { return stage_through_device(c, gpu); }, "staged through cuda:0");
}

// What the nodes log before staging GPU tensors: the memory types this UCX can move
// (host always; cuda only with UCX's CUDA module, which Debian's UCX lacks).
TEST(HostStaging, UcxReportsTheMemoryTypesItCanMove) {
  const auto types = ucx_memory_types();
  EXPECT_NE(std::find(types.begin(), types.end(), "host"), types.end());
}

// An aborted work leaves the caller's tensor as it was and fails with the caller's
// reason; a communicator's abort fails its pending staged works; bad tensors are refused
// before anything is copied.
TEST(HostStaging, AbortsAndBadTensorsAreErrors) {
  auto inner = make_local_group(2);
  auto a = stage_through_host(inner[0], true), b = stage_through_host(inner[1], true);
  auto dst = torch::full({4}, 5.0f);
  auto w = b->recv(dst, 0, 9);
  EXPECT_FALSE(w->wait(std::chrono::milliseconds(20)));
  w->abort("the step was aborted");
  EXPECT_THROW(w->wait(std::chrono::seconds(1)), transport_error);
  EXPECT_NE(w->error().find("the step was aborted"), std::string::npos) << w->error();
  EXPECT_TRUE(torch::equal(dst, torch::full({4}, 5.0f)));

  auto t = torch::ones({3});
  auto pending = a->all_reduce(t);
  EXPECT_FALSE(pending->wait(std::chrono::milliseconds(20)));
  b->abort("rank 1 died");
  EXPECT_THROW(pending->wait(std::chrono::seconds(1)), transport_error);
  EXPECT_NE(pending->error().find("rank 1 died"), std::string::npos) << pending->error();
  EXPECT_TRUE(torch::equal(t, torch::ones({3})));

  EXPECT_THROW(a->all_reduce(torch::ones({2, 2}).t()), std::invalid_argument);  // not contiguous
  EXPECT_THROW(a->send(torch::Tensor(), 1, 1), std::invalid_argument);
}

class TransportProcesses : public ::testing::TestWithParam<std::tuple<int, std::string>> {};

// Every collective (1 element .. 64 MiB, uneven sizes, float32 and int64) and send/recv
// between 2, 3 and 4 processes equal the ring-order reference bit for bit and gloo within
// float tolerance (bit for bit for int64).
TEST_P(TransportProcesses, CollectivesMatchReferenceAndGloo) {
  const auto [n, link] = GetParam();
  if (std::string(TROUPE_TRANSPORT_PEER).empty()) GTEST_SKIP() << "built without gloo headers: no transport peer";
  test::temp_dir dir;
  const auto results = run_peers("check", n, transports_of(link), dir, std::chrono::seconds(240));
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(results[r].status, 0) << "rank " << r << " (" << link << "):\n" << results[r].output;
    EXPECT_NE(results[r].output.find("ok"), std::string::npos) << results[r].output;
  }
}

INSTANTIATE_TEST_SUITE_P(Ucx, TransportProcesses,
                         ::testing::Combine(::testing::Values(2, 3, 4), ::testing::Values("shm", "tcp")),
                         [](const auto& info) {
                           return std::get<1>(info.param) + "_" + std::to_string(std::get<0>(info.param)) + "ranks";
                         });

// Ranks that call different collectives at the same position get an error (naming the
// mismatch) instead of hanging.
TEST(TransportProcesses, MismatchedCollectivesFailOnEveryRank) {
  if (std::string(TROUPE_TRANSPORT_PEER).empty()) GTEST_SKIP() << "built without gloo headers: no transport peer";
  test::temp_dir dir;
  const auto results = run_peers("mismatch", 3, "sm,self", dir, std::chrono::seconds(60));
  std::string all;
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(results[r].status, 0) << results[r].output;
    all += results[r].output;
  }
  EXPECT_NE(all.find("collective order mismatch"), std::string::npos) << all;
}
