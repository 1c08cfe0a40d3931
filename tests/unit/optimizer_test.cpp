#include <gtest/gtest.h>

#include <torch/optim/adamw.h>

#include "compute/optim/optimizer.hpp"

namespace troupe {

// Our flat-shard AdamW against LibTorch's own torch::optim::AdamW on the same data:
// one tensor with weight decay, one without, several steps with changing lr.
TEST(Optimizer, AdamwShardEqualsTorchAdamw) {
  torch::manual_seed(3);
  auto w = torch::randn({40, 5}), b = torch::randn({5});
  auto pw = w.clone().requires_grad_(true), pb = b.clone().requires_grad_(true);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<torch::Tensor>{pw},
                      std::make_unique<torch::optim::AdamWOptions>(
                          torch::optim::AdamWOptions(1e-3).betas({0.9, 0.95}).eps(1e-8).weight_decay(0.1)));
  groups.emplace_back(std::vector<torch::Tensor>{pb},
                      std::make_unique<torch::optim::AdamWOptions>(
                          torch::optim::AdamWOptions(1e-3).betas({0.9, 0.95}).eps(1e-8).weight_decay(0.0)));
  torch::optim::AdamW ref(groups);

  auto flat = torch::cat({w.reshape({-1}), b});
  auto mask = torch::cat({torch::ones({200}, torch::kBool), torch::zeros({5}, torch::kBool)});
  adamw_shard shard(flat, mask, {0.9, 0.95, 1e-8, 0.1});
  for (int step = 0; step < 6; ++step) {
    const double lr = 1e-3 * (step + 1);
    auto gw = torch::randn({40, 5}), gb = torch::randn({5});
    for (auto& g : ref.param_groups()) static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr);
    pw.mutable_grad() = gw.clone();
    pb.mutable_grad() = gb.clone();
    ref.step();
    shard.step(torch::cat({gw.reshape({-1}), gb}), lr);
  }
  auto ours = shard.params();
  EXPECT_LE((ours.narrow(0, 0, 200) - pw.detach().reshape({-1})).abs().max().item<double>(), 1e-7);
  EXPECT_LE((ours.narrow(0, 200, 5) - pb.detach()).abs().max().item<double>(), 1e-7);
  EXPECT_EQ(shard.steps(), 6);
}

TEST(Optimizer, GradScaleIsAppliedBeforeTheMoments) {
  auto p = torch::ones({4});
  auto mask = torch::zeros({4}, torch::kBool);
  adamw_shard a(p, mask, {}), b(p, mask, {});
  auto g = torch::tensor({1.0f, -2.0f, 3.0f, 0.5f});
  a.step(g, 1e-2, 0.25);
  b.step(g * 0.25, 1e-2);
  EXPECT_TRUE(torch::equal(a.exp_avg(), b.exp_avg()));
  EXPECT_TRUE(torch::equal(a.params(), b.params()));
}

// Double buffering (what the shard actors' snapshots rely on) and the split over threads
// change no bit of the update; the state before the last update stays readable.
TEST(Optimizer, DoubleBufferedAndThreadedUpdatesAreBitIdentical) {
  torch::manual_seed(5);
  const std::int64_t n = 300001;  // several pieces of the thread split, odd tail
  auto p = torch::randn({n});
  auto mask = torch::rand({n}) > 0.3;
  adamw_shard plain(p, mask, {}), buffered(p, mask, {}, /*double_buffered=*/true);
  for (int step = 0; step < 3; ++step) {
    auto g = torch::randn({n});
    const auto before = buffered.current();
    const auto before_params = before.params.clone();
    plain.step(g, 1e-3 * (step + 1), 0.5);
    buffered.step(g, 1e-3 * (step + 1), 0.5, /*threads=*/4);
    EXPECT_TRUE(torch::equal(plain.params(), buffered.params()));
    EXPECT_TRUE(torch::equal(plain.exp_avg(), buffered.exp_avg()));
    EXPECT_TRUE(torch::equal(plain.exp_avg_sq(), buffered.exp_avg_sq()));
    EXPECT_EQ(buffered.steps(), step + 1);
    // The previous state is the one before this update, untouched by it.
    EXPECT_EQ(buffered.previous().params.data_ptr(), before.params.data_ptr());
    EXPECT_NE(buffered.params().data_ptr(), before.params.data_ptr());
    EXPECT_TRUE(torch::equal(buffered.previous().params, before_params));
    EXPECT_EQ(buffered.previous().steps, step);
  }
  // Restoring a state (an in-place retry) and updating again gives the same result.
  adamw_shard restored(p, mask, {}, true);
  restored.assign(buffered.previous());
  auto g = torch::randn({n});
  buffered.assign(buffered.previous());  // back to the state before the last update
  buffered.step(g, 1e-3);
  restored.step(g, 1e-3);
  EXPECT_TRUE(torch::equal(restored.params(), buffered.params()));
  EXPECT_EQ(restored.steps(), buffered.steps());
}

// Between a step's commit and the next update a shard releases the state before the
// step (the optimizer shard actor at the next begin_step): the bank is made again by the
// next update, whose results are those of a shard that kept it.
TEST(Optimizer, ReleasedPreviousStateChangesNoUpdate) {
  torch::manual_seed(6);
  const std::int64_t n = 1001;
  auto p = torch::randn({n});
  auto mask = torch::rand({n}) > 0.3;
  adamw_shard kept(p, mask, {}, /*double_buffered=*/true), released(p, mask, {}, true);
  for (int step = 0; step < 4; ++step) {
    auto g = torch::randn({n});
    kept.step(g, 1e-3);
    released.step(g, 1e-3);
    const auto before = released.previous().params;
    released.release_previous();
    EXPECT_EQ(released.previous().params.data_ptr(), released.params().data_ptr());  // only one copy left
    EXPECT_EQ(before.use_count(), 1) << "the released bank is held by its last user only";
    EXPECT_TRUE(torch::equal(kept.params(), released.params()));
    EXPECT_TRUE(torch::equal(kept.exp_avg_sq(), released.exp_avg_sq()));
    EXPECT_EQ(kept.steps(), released.steps());
  }
  adamw_shard single(p, mask, {});  // one bank: nothing to release
  single.release_previous();
  EXPECT_TRUE(torch::equal(single.params(), p));
}

// The fused CPU kernel against the same update as LibTorch ops (taken for tensors that
// are not contiguous, as on a GPU), with and without weight decay, in one bank and
// double-buffered (where the ops write the other bank from this one and leave it as it
// was: previous()).
TEST(Optimizer, FusedKernelMatchesTorchOps) {
  for (const bool buffered : {false, true}) {
    for (const double decay : {0.1, 0.0}) {
      torch::manual_seed(6);
      const std::int64_t n = 1000;
      auto p = torch::randn({n});
      auto mask = torch::rand({n}) > 0.5;
      adamw_options opts;
      opts.weight_decay = decay;
      adamw_shard fused(p, mask, opts, buffered), ops(p, mask, opts, buffered);
      for (int step = 0; step < 4; ++step) {
        auto g2 = torch::randn({n, 2});
        auto strided = g2.select(1, 0);  // not contiguous: the LibTorch-ops path
        ASSERT_FALSE(strided.is_contiguous());
        const auto before = ops.params().clone();
        fused.step(strided.contiguous(), 1e-2, 0.7);
        ops.step(strided, 1e-2, 0.7);
        if (buffered) EXPECT_TRUE(torch::equal(ops.previous().params, before)) << "step " << step;
        EXPECT_FALSE(torch::equal(ops.params(), before));
      }
      // Equal up to rounding (LibTorch's vectorised kernels may fuse a multiply-add).
      const auto what = std::string(buffered ? "double-buffered" : "one bank") + ", decay " + std::to_string(decay);
      EXPECT_TRUE(torch::allclose(fused.params(), ops.params(), 1e-6, 1e-7)) << what;
      EXPECT_TRUE(torch::allclose(fused.exp_avg(), ops.exp_avg(), 1e-6, 1e-7)) << what;
      EXPECT_TRUE(torch::allclose(fused.exp_avg_sq(), ops.exp_avg_sq(), 1e-6, 1e-7)) << what;
    }
  }
}

TEST(Optimizer, MaskedNormOfManyElements) {
  torch::manual_seed(7);
  auto g = torch::randn({100003});
  auto mask = torch::rand({100003}) > 0.25;
  const auto ref = g.to(torch::kFloat64).masked_select(mask).pow(2).sum().item<double>();
  EXPECT_NEAR(partial_sq_norm(g, mask), ref, 1e-12 * ref);
  EXPECT_EQ(partial_sq_norm(g, mask), partial_sq_norm(g.clone(), mask.clone()));  // fixed order
  // The LibTorch-ops path (GPUs take it; here a mask that is not contiguous does).
  const auto strided = torch::stack({mask, mask}, 1).select(1, 0);
  ASSERT_FALSE(strided.is_contiguous());
  EXPECT_NEAR(partial_sq_norm(g, strided), ref, 1e-12 * ref);
}

// A shard's masks (weight decay, the gradient norm) on the CPU are their runs, not a byte
// per element: the runs give the mask back, and the norm over them the bool mask's bits.
TEST(Optimizer, AShardMaskOnTheCpuIsItsRunsWithTheSameNorm) {
  torch::manual_seed(8);
  const std::int64_t n = 100003;
  auto mask = torch::zeros({n}, torch::kBool);
  std::int64_t runs = 0;
  for (std::int64_t at = 0; at < n; ++runs) {  // runs of 1 to 5000 elements, alternating
    const auto len = std::min(n - at, std::int64_t(1) + torch::randint(5000, {1}).item<std::int64_t>());
    if (runs % 2 == 1) mask.narrow(0, at, len).fill_(true);
    at += len;
  }
  const shard_mask m(mask);
  EXPECT_FALSE(m.tensor.defined());
  EXPECT_EQ(std::int64_t(m.runs.size()), runs);
  EXPECT_TRUE(torch::equal(m.expanded(), mask));
  const auto g = torch::randn({n});
  const double bits = partial_sq_norm(g, mask);
  EXPECT_GT(bits, 0.0);
  EXPECT_EQ(partial_sq_norm(g, m), bits);
  // (Weight decay by runs against the mask as LibTorch ops: FusedKernelMatchesTorchOps.)
}

TEST(Optimizer, LearningRateScheduleOfWorkloads) {
  lr_schedule s;  // 1e-3 peak, 1e-4 floor, 20 warm-up steps
  EXPECT_DOUBLE_EQ(s.at(0, 200), 1e-3 / 20);
  EXPECT_DOUBLE_EQ(s.at(9, 200), 1e-3 * 10 / 20);
  EXPECT_DOUBLE_EQ(s.at(19, 200), 1e-3);
  EXPECT_DOUBLE_EQ(s.at(20, 200), 1e-3);
  EXPECT_NEAR(s.at(199, 200), 1e-4, 1e-15);
  EXPECT_NEAR(s.at(20 + 179 / 2, 200), 0.55e-3, 5e-6);  // half way down the cosine
  EXPECT_GT(s.at(100, 200), s.at(101, 200));
  lr_schedule constant{1e-3, 1e-3, 0};
  EXPECT_DOUBLE_EQ(constant.at(0, 937), 1e-3);
  EXPECT_DOUBLE_EQ(constant.at(500, 937), 1e-3);
}

TEST(Optimizer, GlobalNormFromPartialNorms) {
  auto g = torch::tensor({3.0f, 4.0f, 12.0f, 100.0f});
  auto mask = torch::tensor({true, true, true, false});
  const double a = partial_sq_norm(g.narrow(0, 0, 2), mask.narrow(0, 0, 2));
  const double b = partial_sq_norm(g.narrow(0, 2, 2), mask.narrow(0, 2, 2));
  EXPECT_DOUBLE_EQ(a + b, 169.0);  // 100 is masked out (a shared copy)
  EXPECT_NEAR(clip_factor(a + b, 1.0), 1.0 / (13.0 + 1e-6), 1e-15);
  EXPECT_EQ(clip_factor(0.25, 1.0), 1.0);
}

}  // namespace troupe
