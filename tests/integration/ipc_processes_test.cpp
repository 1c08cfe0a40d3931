// transport/ipc between processes over UCX (tests/integration/ipc_peer.cpp): shared
// memory on any machine, CUDA IPC on a GPU.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "compute/runtime/device.hpp"
#include "process_group.hpp"
#include "temp_dir.hpp"
#include "transport/ipc/ipc.hpp"
#include "build_paths.hpp"

using namespace troupe;
using namespace troupe::transport;

namespace {

void run_ipc_peers(const std::string& kind) {
  test::temp_dir dir;
  const int n = 2;
  test::process_group group(
      n,
      [&](int r) {
        return std::vector<std::string>{troupe::test::ipc_peer, kind, std::to_string(r), std::to_string(n), dir.path.string()};
      },
      {"UCX_TLS=sm,self", "OMP_NUM_THREADS=1"}, dir.path.string());
  const auto results = group.wait(std::chrono::seconds(240));
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(results[r].status, 0) << "rank " << r << ":\n" << results[r].output;
    EXPECT_NE(results[r].output.find("ok 48 messages"), std::string::npos) << results[r].output;
  }
  // For each of 3 sizes above the inline one, a buffer per message in flight at most (3),
  // reused over the 4 rounds (without reuse: 36); what one rank exports the other maps.
  int exported[2] = {0, 0}, mapped[2] = {0, 0};
  for (int r = 0; r < n; ++r) {
    const auto& out = results[r].output;
    const auto at = out.find("exported ");
    ASSERT_NE(at, std::string::npos) << out;
    ASSERT_EQ(std::sscanf(out.c_str() + at, "exported %d buffers, mapped %d", &exported[r], &mapped[r]), 2) << out;
    EXPECT_GE(exported[r], 3) << out;
    EXPECT_LE(exported[r], 9) << out;
  }
  EXPECT_EQ(exported[0], mapped[1]);
  EXPECT_EQ(exported[1], mapped[0]);
}

}  // namespace

// Between two processes over UCX: POSIX shared memory on any machine ...
TEST(IpcProcesses, TwoProcessesThroughSharedHostMemory) { run_ipc_peers("host"); }

// ... and CUDA IPC buffers on one GPU.
TEST(IpcProcesses, TwoProcessesThroughCudaIpcOnOneGpu) {
  if (!cuda_usable()) GTEST_SKIP() << "no usable GPU (or a LibTorch without CUDA)";
  if (!cuda_ipc_built()) GTEST_SKIP() << "built without the CUDA runtime: no CUDA IPC";
  run_ipc_peers("cuda");
}
