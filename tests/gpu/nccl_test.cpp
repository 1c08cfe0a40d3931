// The NCCL backend of transport/. Its collectives need a GPU per rank: with one GPU
// (the machines this project is tested on) one rank runs every collective for real, and
// a communicator whose second rank never joins must time out and abort, not hang.
// Without a GPU (CI) these tests skip; a build without NCCL says so clearly.
#include <gtest/gtest.h>

#include "compute/runtime/device.hpp"
#include "transport/host_staging.hpp"
#include "transport/ipc/ipc.hpp"
#include "transport/nccl/nccl_communicator.hpp"

namespace troupe::transport {

namespace {
bool gpu_with_nccl() { return nccl_built() && cuda_usable(); }
}  // namespace

TEST(NcclBackend, ABuildWithoutNcclSaysSo) {
  if (nccl_built()) GTEST_SKIP() << "this build has the NCCL backend";
  try {
    nccl_unique_id();
    FAIL() << "expected an error";
  } catch (const transport_error& e) {
    EXPECT_NE(std::string(e.what()).find("no NCCL backend"), std::string::npos) << e.what();
  }
}

TEST(NcclBackend, OneRankRunsEveryCollectiveOnTheGpu) {
  if (!gpu_with_nccl()) GTEST_SKIP() << "needs a GPU and the NCCL backend";
  auto comm = make_nccl_communicator(nccl_unique_id(), 0, 1, 0);
  EXPECT_EQ(comm->backend(), "nccl");
  const auto gpu = torch::TensorOptions().device(torch::kCUDA, 0);
  const auto timeout = std::chrono::seconds(30);

  auto a = torch::arange(1000, gpu.dtype(torch::kFloat32));
  comm->all_reduce(a)->wait_or_throw(timeout);
  EXPECT_TRUE(torch::equal(a.cpu(), torch::arange(1000, torch::kFloat32)));

  auto b = torch::ones({4096}, gpu.dtype(torch::kBFloat16));
  comm->all_reduce(b)->wait_or_throw(timeout);
  EXPECT_TRUE(torch::equal(b.cpu(), torch::ones({4096}, torch::kBFloat16)));

  auto in = torch::randn({512}, gpu), out = torch::empty({512}, gpu);
  comm->reduce_scatter(in, out)->wait_or_throw(timeout);
  EXPECT_TRUE(torch::equal(in.cpu(), out.cpu()));

  auto gathered = torch::zeros({512}, gpu);
  comm->all_gather(in, gathered)->wait_or_throw(timeout);
  EXPECT_TRUE(torch::equal(in.cpu(), gathered.cpu()));

  auto ids = torch::arange(7, gpu.dtype(torch::kInt64));
  comm->broadcast(ids, 0)->wait_or_throw(timeout);
  EXPECT_TRUE(torch::equal(ids.cpu(), torch::arange(7, torch::kInt64)));

  // An all-to-all of one rank: its own piece, sent to and received from itself in one
  // NCCL group; nothing to move is no call at all.
  auto rows = torch::arange(12, gpu.dtype(torch::kFloat32)), got = torch::zeros({12}, gpu);
  comm->all_to_all(rows, {12}, got, {12})->wait_or_throw(timeout);
  EXPECT_TRUE(torch::equal(rows.cpu(), got.cpu()));
  comm->all_to_all(rows.narrow(0, 0, 0), {0}, got.narrow(0, 0, 0), {0})->wait_or_throw(timeout);

  // Bad input is refused before anything is queued.
  EXPECT_THROW(comm->all_to_all(rows, {11}, got, {12}), std::invalid_argument);  // counts not the tensor's
  EXPECT_THROW(comm->all_to_all(rows, {6, 6}, got, {6, 6}), std::invalid_argument);  // 2 ranks' counts
  EXPECT_THROW(comm->all_reduce(torch::ones({3})), std::invalid_argument);            // CPU tensor
  EXPECT_THROW(comm->all_reduce(torch::ones({3}, gpu.dtype(torch::kBool))), std::invalid_argument);
  EXPECT_THROW(comm->reduce_scatter(in, torch::empty({3}, gpu)), std::invalid_argument);
  EXPECT_THROW(comm->broadcast(ids, 1), std::invalid_argument);

  // After an abort every operation fails with the reason.
  comm->abort("step 3 aborted");
  auto w = comm->all_reduce(a);
  EXPECT_THROW(w->wait_or_throw(timeout), transport_error);
  EXPECT_NE(w->error().find("step 3 aborted"), std::string::npos) << w->error();
}

// What a node's shard group over NCCL is: NCCL behind stage_through_device, so that
// host tensors (a rejoined node's shard state comes from buddy copies in host memory) go
// through the GPU and come back, while GPU tensors pass straight through.
TEST(NcclBackend, HostTensorsAreStagedThroughTheGpu) {
  if (!gpu_with_nccl()) GTEST_SKIP() << "needs a GPU and the NCCL backend";
  const torch::Device gpu(torch::kCUDA, 0);
  auto comm = stage_through_device(make_nccl_communicator(nccl_unique_id(), 0, 1, 0), gpu);
  EXPECT_NE(comm->backend().find("staged through cuda:0"), std::string::npos) << comm->backend();
  const auto timeout = std::chrono::seconds(30);
  auto in = torch::randn({1024}), out = torch::zeros({1024});
  comm->all_gather(in, out)->wait_or_throw(timeout);
  EXPECT_TRUE(torch::equal(in, out));
  auto summed = torch::arange(300, torch::kFloat32);
  comm->all_reduce(summed)->wait_or_throw(timeout);
  EXPECT_TRUE(torch::equal(summed, torch::arange(300, torch::kFloat32)));
  auto mixed_in = torch::randn({512}, gpu), mixed_out = torch::zeros({512});
  comm->reduce_scatter(mixed_in, mixed_out)->wait_or_throw(timeout);
  EXPECT_TRUE(torch::equal(mixed_in.cpu(), mixed_out));
  // Two node processes on this GPU would name the same GPU: the nodes keep such groups
  // on UCX (nccl_refusal); the key is stable and names the machine.
  EXPECT_EQ(gpu_key(0), gpu_key(0));
  EXPECT_EQ(gpu_key(0).rfind(machine_key(), 0), 0u) << gpu_key(0);
}

TEST(NcclBackend, ARankThatNeverJoinsTimesOutAndAborts) {
  if (!gpu_with_nccl()) GTEST_SKIP() << "needs a GPU and the NCCL backend";
  nccl_options opts;
  opts.timeout = std::chrono::seconds(3);
  const auto start = std::chrono::steady_clock::now();
  try {
    make_nccl_communicator(nccl_unique_id(), 0, 2, 0, opts);  // rank 1 never comes
    FAIL() << "expected a timeout";
  } catch (const transport_error& e) {
    EXPECT_NE(std::string(e.what()).find("timed out"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
}

}  // namespace troupe::transport
