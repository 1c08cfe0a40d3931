// Devices: names, one GPU per node process of a machine, deterministic mode, the GPU op
// clock. They run everywhere (the GPU parts skip without a GPU).
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

TEST(Device, NamesAreParsedAndCudaWithoutAGpuIsRefused) {
  EXPECT_TRUE(resolve_device("cpu").is_cpu());
  EXPECT_EQ(resolve_device("auto").is_cuda(), cuda_usable());
  EXPECT_THROW(resolve_device("tpu"), std::invalid_argument);
  EXPECT_THROW(parse_precision("fp8"), std::invalid_argument);
  if (!cuda_usable()) {
    EXPECT_THROW(resolve_device("cuda"), std::invalid_argument);
    // The run refuses it up front, as a configuration error.
    auto c = tiny(1, 1, 1, "1f1b", "cuda");
    EXPECT_THROW(runtime_context{c}, config_error);
  }
  auto bad = tiny(1, 1, 1, "1f1b", "cpu", "fp16");
  EXPECT_THROW(bad.validate(), config_error);
}

// Node processes of one machine: "cuda" gives each its own GPU while there are enough,
// then they share; explicit devices and the CPU are kept.
TEST(Device, NodeProcessesOfAMachineTakeAGpuEach) {
  EXPECT_EQ(node_device("cuda", 0, 8), "cuda:0");
  EXPECT_EQ(node_device("cuda", 3, 8), "cuda:3");
  EXPECT_EQ(node_device("cuda", 9, 8), "cuda:1");
  EXPECT_EQ(node_device("cuda", 2, 1), "cuda:0");
  EXPECT_EQ(node_device("cuda", 2, 0), "cuda");  // no GPU: resolve_device says so
  EXPECT_EQ(node_device("cuda:5", 1, 8), "cuda:5");
  EXPECT_EQ(node_device("cpu", 1, 8), "cpu");
  EXPECT_EQ(node_device("auto", 1, 8), "auto");
  EXPECT_EQ(cuda_device_count() > 0, cuda_usable());
}

// deterministic = true: LibTorch's deterministic algorithms strict (not warn-only: only
// then does LibTorch take its deterministic attention backwards) and cuDNN deterministic;
// cuBLAS's workspace setting is set when unset, kept when it is one of cuBLAS's two
// deterministic ones, refused otherwise; off again for the next job of the process.
TEST(Device, DeterministicModeSetsLibTorchAndCublas) {
  struct restore {
    std::string saved;
    bool had = false;
    restore() {
      if (const char* v = std::getenv("CUBLAS_WORKSPACE_CONFIG")) had = true, saved = v;
    }
    ~restore() {
      had ? setenv("CUBLAS_WORKSPACE_CONFIG", saved.c_str(), 1) : unsetenv("CUBLAS_WORKSPACE_CONFIG");
      use_deterministic_algorithms(false);
    }
  } env;
  auto& ctx = at::globalContext();
  unsetenv("CUBLAS_WORKSPACE_CONFIG");
  use_deterministic_algorithms(true);
  EXPECT_TRUE(ctx.deterministicAlgorithms());
  EXPECT_FALSE(ctx.deterministicAlgorithmsWarnOnly());
  EXPECT_TRUE(ctx.deterministicCuDNN());
  ASSERT_NE(std::getenv("CUBLAS_WORKSPACE_CONFIG"), nullptr);
  EXPECT_STREQ(std::getenv("CUBLAS_WORKSPACE_CONFIG"), ":4096:8");
  setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8", 1);
  use_deterministic_algorithms(true);
  EXPECT_STREQ(std::getenv("CUBLAS_WORKSPACE_CONFIG"), ":16:8");
  use_deterministic_algorithms(false);
  EXPECT_FALSE(ctx.deterministicAlgorithms());
  EXPECT_FALSE(ctx.deterministicCuDNN());
  setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0", 1);
  EXPECT_THROW(use_deterministic_algorithms(true), std::invalid_argument);
  EXPECT_FALSE(ctx.deterministicAlgorithms());  // refused: nothing was turned on
}

// The GPU op clock on the CPU marks nothing (on a GPU: gpu_test.cpp).
TEST(Device, OpClockOnTheCpuMarksNothing) {
  gpu_op_clock clock(torch::kCPU);
  EXPECT_FALSE(clock.active());
  clock.anchor([] { return 1.0; });
  EXPECT_EQ(clock.mark(), -1);
  EXPECT_THROW(clock.at_us(0), std::out_of_range);
}

}  // namespace troupe
