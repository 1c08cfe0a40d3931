// Staged communicators: GPU tensors through host memory (what they take over UCX between
// nodes) and host tensors through a GPU (what the nodes put in front of NCCL) give the
// unstaged backend's results bit for bit.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <functional>
#include <optional>
#include <thread>

#include "launch/environment.hpp"
#include "compute/runtime/device.hpp"
#include "test_util.hpp"
#include "process_group.hpp"
#include "rank_threads.hpp"
#include "transport/host_staging.hpp"
#include "transport/local/local_group.hpp"
#include "transport/ucx/ucx_communicator.hpp"

using namespace troupe;
using namespace troupe::transport;
using test::inputs;
using test::on_threads;

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
TEST(HostStaging, HostTensorsThroughTheGpuGiveTheSameResults) {
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
