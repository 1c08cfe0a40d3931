// One rank of the ipc transport checks between processes (tests/integration/ipc_test.cpp): ranks in a
// ring over UCX, each sending to the next through transport/ipc and receiving from the
// one before, and checking every element.
//
//   troupe_ipc_peer host|cuda RANK SIZE DIR
//
// host: CPU tensors through POSIX shared memory; cuda: tensors on GPU 0 through CUDA IPC
// buffers (the small ones over UCX, staged through host memory). Prints "ok" and how many
// buffers it exported and mapped; exit 1 on a wrong element or an error.
#include <torch/torch.h>

#include <cstdio>
#include <iostream>

#include "counting_memory.hpp"
#include "transport/host_staging.hpp"
#include "transport/ipc/ipc.hpp"
#include "transport/ucx/ucx_communicator.hpp"

using namespace troupe::transport;

namespace {

torch::Tensor expected(std::int64_t n, int src, int round, int k, const torch::TensorOptions& o) {
  return torch::arange(n, o.dtype(torch::kFloat32)) + float(1000 * src + 7 * round + k);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) {
    std::cerr << "usage: troupe_ipc_peer host|cuda RANK SIZE DIR\n";
    return 2;
  }
  try {
    const std::string kind = argv[1];
    const int rank = std::stoi(argv[2]), size = std::stoi(argv[3]);
    const std::string dir = argv[4];
    torch::set_num_threads(1);
    const bool cuda = kind == "cuda";
    const auto device = cuda ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
    auto memory = std::make_shared<troupe::test::counting_memory>(cuda ? cuda_ipc_memory(0) : host_ipc_memory());
    auto inner = make_ucx_communicator(rank, size, folder_exchange(dir + "/ucx", rank, size));
    auto comm = ipc_p2p(cuda ? stage_through_host(inner) : inner, memory, std::vector<bool>(size, true));
    const int next = (rank + 1) % size, prev = (rank + size - 1) % size;
    const auto opts = torch::TensorOptions().device(device);
    const auto timeout = std::chrono::seconds(60);
    int checked = 0;
    // 3 elements go over UCX (inline); the others through buffers, 3 in flight, reused
    // over the rounds (and larger ones made when a larger tensor comes).
    for (std::int64_t n : {std::int64_t(3), std::int64_t(5000), std::int64_t(300000), std::int64_t(4) << 20})
      for (int round = 0; round < 4; ++round) {
        std::vector<torch::Tensor> in, out;
        std::vector<work_ptr> works;
        for (int k = 0; k < 3; ++k) {
          in.push_back(torch::full({n}, -1.0f, opts));
          works.push_back(comm->recv(in.back(), prev, std::uint32_t(k)));
        }
        for (int k = 0; k < 3; ++k) {
          out.push_back(expected(n, rank, round, k, opts));
          works.push_back(comm->send(out.back(), next, std::uint32_t(k)));
        }
        for (auto& w : works) w->wait_or_throw(timeout);
        for (int k = 0; k < 3; ++k) {
          if (!torch::equal(in[k].cpu(), expected(n, prev, round, k, torch::TensorOptions()))) {
            std::cerr << "rank " << rank << ": wrong elements from rank " << prev << " (" << n << " elements, round "
                      << round << ", message " << k << ")\n";
            return 1;
          }
          ++checked;
        }
      }
    std::printf("ok %d messages, %s, exported %d buffers, mapped %d\n", checked, comm->backend().c_str(),
                memory->allocated.load(), memory->opened.load());
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "troupe_ipc_peer: " << e.what() << "\n";
    return 1;
  }
}
