// On a GPU (skipped without one, reported as skipped, never as passed): bf16's loss
// curve follows fp32's, the op clock times the GPU rather than the launch, a GPU run's
// checkpoint resumes on the CPU.
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

// bf16 on the GPU, with the fp32 residual stream and with a bf16 one: after 200 steps the
// loss curve is within 2 % of fp32's (mean of the last 10 steps), and every 20th step's
// loss within 5 %.
TEST(Gpu, Bf16LossCurveFollowsFp32For200Steps) {
  if (!cuda_usable()) GTEST_SKIP() << "no usable GPU (or a LibTorch without CUDA)";
  const auto fp32 = run(tiny(2, 1, 1, "1f1b", "cuda"), 200);
  for (const bool fp32_residual : {true, false}) {
    auto c = tiny(2, 1, 1, "1f1b", "cuda", "bf16");
    c.fp32_residual = fp32_residual;
    const auto bf16 = run(c, 200);
    ASSERT_EQ(fp32.exit_code, 0) << fp32.error;
    ASSERT_EQ(bf16.exit_code, 0) << bf16.error;
    ASSERT_EQ(bf16.losses.size(), 200u);
    const auto what = c.fp32_residual ? "fp32 residual" : "bf16 residual";
    EXPECT_NEAR(mean_of_last(bf16.losses, 10) / mean_of_last(fp32.losses, 10), 1.0, 0.02) << what;
    for (int i = 0; i < 200; i += 20) EXPECT_NEAR(bf16.losses[i] / fp32.losses[i], 1.0, 0.05) << what << ", step " << i;
    EXPECT_LT(mean_of_last(bf16.losses, 10), bf16.losses[0] * 0.8) << what << ": bf16 learns";
  }
}

// The GPU op clock: a mark pair around kernels that take the GPU far longer than the host
// takes to launch them spans the GPU's time, not the launch's, and the marks lie on the
// caller's clock: after the anchor, and before the host saw the work done.
TEST(Gpu, OpClockTimesTheGpuNotTheLaunch) {
  if (!cuda_usable()) GTEST_SKIP() << "no usable GPU (or a LibTorch without CUDA)";
  const torch::Device dev(torch::kCUDA, 0);
  const auto t0 = std::chrono::steady_clock::now();
  auto now_us = [&] { return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count(); };
  auto a = torch::randn({4096, 4096}, torch::TensorOptions().device(dev));
  a = torch::mm(a, a).tanh_();  // warm-up: cuBLAS's handle and workspace, the allocator's blocks
  synchronize(dev);
  gpu_op_clock clock(dev);
  clock.anchor(now_us);
  const double anchored = now_us();
  const int m0 = clock.mark();
  const double launch0 = now_us();
  for (int i = 0; i < 40; ++i) a = torch::mm(a, a).tanh_();  // ~5.5 TFLOP: several ms on any GPU
  const double launch1 = now_us();
  const int m1 = clock.mark();
  synchronize(dev);
  const double done = now_us();
  const double g0 = clock.at_us(m0), g1 = clock.at_us(m1);
  EXPECT_GE(g0, anchored - 1000.0);
  EXPECT_LE(g1, done + 1000.0);
  EXPECT_GT(g1 - g0, 4.0 * (launch1 - launch0)) << "GPU " << g1 - g0 << " us, launch " << launch1 - launch0 << " us";
  EXPECT_GT(done - launch1, 0.5 * (g1 - g0));  // the host did wait for the work after launching it
}

// A stage's next input goes to the GPU without the host waiting for the kernels queued
// before it (to_device_async): when the call returns they are still running. A plain
// .to() waits for them (why the helper exists). The values arrive either way.
TEST(Gpu, AnInputCopyDoesNotWaitForQueuedKernels) {
  if (!cuda_usable()) GTEST_SKIP() << "no usable GPU (or a LibTorch without CUDA)";
  const torch::Device dev(torch::kCUDA, 0);
  auto a = torch::randn({4096, 4096}, torch::TensorOptions().device(dev));
  const auto host = torch::randint(50000, {16, 1024}, torch::kInt64);
  auto queue = [&] {  // ~5.5 TFLOP: many ms of GPU work, launched in far less
    for (int i = 0; i < 40; ++i) a = torch::mm(a, a).tanh_();
  };
  to_device_async(host, dev);  // warm-up: cuBLAS, the caching host allocator's first block
  queue();
  synchronize(dev);
  queue();
  const auto async_copy = to_device_async(host, dev);
  EXPECT_FALSE(stream_idle(dev)) << "to_device_async waited for the kernels queued before it";
  synchronize(dev);
  queue();
  const auto plain_copy = host.to(dev);
  EXPECT_TRUE(stream_idle(dev)) << "a plain .to() no longer waits for the stream: to_device_async may be unneeded";
  EXPECT_TRUE(torch::equal(async_copy.cpu(), host));
  EXPECT_TRUE(torch::equal(plain_copy.cpu(), host));
}

// A checkpoint folder written by a GPU run (parameters and AdamW moments gathered from
// the GPU) resumes on the CPU; the resumed run ends within 1e-4 of the GPU run's end.
TEST(Gpu, CheckpointOfAGpuRunResumesOnTheCpu) {
  if (!cuda_usable()) GTEST_SKIP() << "no usable GPU (or a LibTorch without CUDA)";
  test::temp_dir dir;
  auto gpu = tiny(2, 2, 1, "1f1b", "cuda");
  gpu.checkpoint_dir = dir / "ckpt";
  gpu.checkpoint_interval = 3;
  const auto straight = run(gpu, 6);
  ASSERT_EQ(straight.exit_code, 0) << straight.error;
  auto cpu = tiny(2, 2, 1, "1f1b", "cpu");
  cpu.resume = dir / "ckpt/step-00000003";
  const auto resumed = run(cpu, 6);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.error;
  ASSERT_EQ(resumed.losses.size(), 3u);
  EXPECT_LE(test::max_abs_diff(resumed.final_state, straight.final_state), 1e-4);
}

}  // namespace troupe
