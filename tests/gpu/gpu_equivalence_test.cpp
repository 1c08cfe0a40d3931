// fp32 on the GPU gives the CPU run's parameters, for every schedule kind (skipped
// without a usable GPU and a CUDA LibTorch: build with launch/setup-gpu).
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <fstream>
#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include "actors/runtime.hpp"
#include "compute/checkpoint/checkpoint.hpp"
#include "compute/runtime/device.hpp"
#include "compute/trainer/local_pipeline.hpp"
#include "compute/models/partition.hpp"
#include "compute/trainer/local_trainer.hpp"
#include "gpu_jobs.hpp"
#include "held_bytes.hpp"
#include "test_util.hpp"


namespace troupe {

using namespace gpu_jobs;

namespace {

struct gpu_layout {
  int p, d, v;
  const char* schedule;
};

std::string name_of(const gpu_layout& l) {
  std::string k = l.schedule;
  for (auto& ch : k)
    if (ch == '-') ch = '_';
  return "p" + std::to_string(l.p) + "_d" + std::to_string(l.d) + "_v" + std::to_string(l.v) + "_" + k;
}
void PrintTo(const gpu_layout& l, std::ostream* os) { *os << name_of(l); }

class GpuEquivalence : public ::testing::TestWithParam<gpu_layout> {};

}  // namespace

// fp32 on the GPU: the same parameters as the same layout on the CPU (<= 1e-4 after 10
// steps), for stages sharing one GPU (each on its own stream) and data-parallel shards.
TEST_P(GpuEquivalence, Fp32OnTheGpuGivesTheCpuParameters) {
  if (!cuda_usable()) GTEST_SKIP() << "no usable GPU (or a LibTorch without CUDA)";
  const auto l = GetParam();
  const auto cpu = run(tiny(l.p, l.d, l.v, l.schedule, "cpu"), 10);
  const auto gpu = run(tiny(l.p, l.d, l.v, l.schedule, "cuda"), 10);
  ASSERT_EQ(cpu.exit_code, 0) << cpu.error;
  ASSERT_EQ(gpu.exit_code, 0) << gpu.error;
  EXPECT_LE(test::max_abs_diff(gpu.final_state, cpu.final_state), 1e-4);
  ASSERT_EQ(gpu.losses.size(), cpu.losses.size());
  for (std::size_t i = 0; i < cpu.losses.size(); ++i) EXPECT_NEAR(gpu.losses[i], cpu.losses[i], 1e-4) << "step " << i;
  for (const auto& [name, t] : gpu.final_state) EXPECT_TRUE(t.device().is_cpu()) << name << ": saved state on the CPU";
}

INSTANTIATE_TEST_SUITE_P(Layouts, GpuEquivalence,
                         ::testing::Values(gpu_layout{1, 1, 1, "1f1b"}, gpu_layout{2, 2, 1, "1f1b"},
                                           gpu_layout{4, 1, 1, "gpipe"}, gpu_layout{2, 1, 2, "interleaved-1f1b"},
                                           gpu_layout{4, 2, 1, "dataflow"}),
                         [](const auto& info) { return name_of(info.param); });

}  // namespace troupe
