// Host-staging benchmark (docs/gpu.md): what a tensor between two node processes costs
// on the path GPU jobs of several nodes take (transport/host_staging.hpp over the UCX
// backend), against references measured in the same run.
//
//   troupe_staging_bench cuda [TLS]   tensors on GPU 0 (both processes share it)
//   troupe_staging_bench cpu [TLS]    CPU tensors staged anyway (the copies' cost alone)
//
// Per size: rank 0 streaming to rank 1 (4 in flight) and a 2-rank all-reduce, each with
// the tensors staged and with plain host tensors over the same UCX communicator; the
// stream again through shared buffers (transport/ipc: CUDA IPC for cuda, POSIX shared
// memory for cpu), and through in-order links (transport/ordered_p2p over tag links: the
// ordering layer of the NCCL links, its control message and posting in seq order, over
// UCX: against the host column for cpu, the staged one for cuda); for cuda also a
// device-to-device copy of the same size in one process.
// (TLS: UCX_TLS for the run, default sm,self.)
#include <torch/torch.h>

#include <cstdio>
#include <iostream>

#include "bench_util.hpp"
#include "compute/runtime/device.hpp"
#include "transport/host_staging.hpp"
#include "transport/ipc/ipc.hpp"
#include "transport/ordered_p2p.hpp"
#include "transport/ucx/ucx_communicator.hpp"

using namespace troupe::transport;
using namespace troupe::bench;

namespace {

int run_rank(const std::string& device_name, int rank, const std::string& dir) {
  torch::set_num_threads(1);
  const auto device = troupe::resolve_device(device_name);
  auto host = make_ucx_communicator(rank, 2, folder_exchange(dir + "/ucx", rank, 2));
  auto staged = stage_through_host(host, /*always=*/true);
  auto ipc = ipc_p2p(staged, device.is_cuda() ? cuda_ipc_memory(0) : host_ipc_memory(), {true, true});
  auto under_links = device.is_cuda() ? staged : host;
  auto link = tag_link(under_links, 1 - rank, 0xfffffff0u);
  auto ordered = rank == 0 ? ordered_p2p(under_links, {nullptr, link}, {}) : ordered_p2p(under_links, {}, {link, nullptr});
  if (rank == 0)
    std::printf("| bytes | send/recv staged MB/s | host MB/s | %s MB/s | in-order links MB/s | all_reduce staged GB/s "
                "| host GB/s |%s\n"
                "| --- | --- | --- | --- | --- | --- | --- |%s\n",
                device.is_cuda() ? "CUDA IPC" : "shared memory (ipc)",
                device.is_cuda() ? " device-to-device copy GB/s |" : "", device.is_cuda() ? " --- |" : "");
  for (std::int64_t bytes : {64ll << 10, 1ll << 20, 16ll << 20, 64ll << 20}) {
    const std::int64_t n = bytes / 4;
    const int iters = int(std::max<std::int64_t>(8, std::min<std::int64_t>(400, (256ll << 20) / bytes)));
    const int reps = bytes >= (16 << 20) ? 5 : 20;
    auto on_device = torch::ones({n}, torch::TensorOptions().device(device));
    auto on_host = torch::ones({n});
    const double p2p_staged = stream_mb_per_s(*staged, on_device, 4, iters);
    const double p2p_host = stream_mb_per_s(*host, on_host, 4, iters);
    const double p2p_ipc = stream_mb_per_s(*ipc, on_device, 4, iters);
    const double p2p_links = stream_mb_per_s(*ordered, on_device, 4, iters);
    auto all_reduce_gbps = [&](communicator& c, torch::Tensor t) {  // 2 ranks: bus bandwidth = bytes / time
      return double(bytes) / time_best(reps, [&] { c.all_reduce(t)->wait_or_throw(kTimeout); }) / 1e9;
    };
    const double ar_staged = all_reduce_gbps(*staged, on_device);
    const double ar_host = all_reduce_gbps(*host, on_host);
    double d2d = 0;
    if (device.is_cuda()) {
      auto dst = torch::empty_like(on_device);
      d2d = double(bytes) / time_best(reps, [&] {
              dst.copy_(on_device);
              troupe::synchronize(device);
            }) / 1e9;
    }
    if (rank == 0) {
      std::printf("| %lld | %.0f | %.0f | %.0f | %.0f | %.2f | %.2f |", (long long)bytes, p2p_staged, p2p_host, p2p_ipc,
                  p2p_links, ar_staged, ar_host);
      if (device.is_cuda()) std::printf(" %.1f |", d2d);
      std::printf("\n");
    }
  }
  std::fflush(stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string mode = argc > 1 ? argv[1] : "";
    if (mode == "rank") return run_rank(argv[2], std::stoi(argv[3]), argv[5]);  // mode, rank, size, folder
    if (mode != "cuda" && mode != "cpu") {
      std::cerr << "usage: troupe_staging_bench cuda|cpu [TLS]\n";
      return 2;
    }
    if (mode == "cuda" && !troupe::cuda_usable()) {
      std::cerr << "troupe_staging_bench: no usable GPU (or a LibTorch without CUDA)\n";
      return 77;
    }
    const std::string tls = argc > 2 ? argv[2] : "sm,self";
    return run_ranks(argv[0], 2, {mode}, tls, "UCX_TLS=" + tls + ", 2 processes, tensors on " + mode);
  } catch (const std::exception& e) {
    std::cerr << "troupe_staging_bench: " << e.what() << "\n";
    return 1;
  }
}
