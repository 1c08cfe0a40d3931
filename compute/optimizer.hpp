#pragma once
// Optimizer math on flat fp32 shards: AdamW (Adam with decoupled weight decay) with a
// per-element decay mask, the warm-up + cosine learning-rate schedule and global-norm
// clipping assembled from per-shard partial norms.
#include <cstdint>

#include <torch/types.h>

namespace troupe {

struct adamw_options {
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
};

/// AdamW state for one contiguous shard: fp32 main parameters, first and second moments.
/// The update follows torch.optim.AdamW (single-tensor path) element for element.
class adamw_shard {
 public:
  adamw_shard() = default;
  /// `main_params`: this shard's fp32 parameters (copied); `decay`: bool mask, same size.
  adamw_shard(const torch::Tensor& main_params, const torch::Tensor& decay, adamw_options opts);

  /// One update with this shard's summed gradient `grad`, scaled first by `grad_scale`
  /// (the global clip factor), at learning rate `lr`.
  void step(const torch::Tensor& grad, double lr, double grad_scale = 1.0);

  const torch::Tensor& params() const { return params_; }
  const torch::Tensor& exp_avg() const { return exp_avg_; }
  const torch::Tensor& exp_avg_sq() const { return exp_avg_sq_; }
  std::int64_t steps() const { return steps_; }
  /// For restoring a checkpoint (tensors are filled in place through the accessors).
  void set_steps(std::int64_t steps) { steps_ = steps; }
  const adamw_options& options() const { return opts_; }

 private:
  adamw_options opts_;
  torch::Tensor params_, exp_avg_, exp_avg_sq_, decay_;
  std::int64_t steps_ = 0;
};

/// Plain Adam is AdamW without weight decay (fmnist-mlp): decay mask all false.

struct lr_schedule {
  double max_lr = 1e-3;
  double min_lr = 1e-4;
  int warmup = 20;
  /// Learning rate at 0-based step `t` of a run of `total` steps (WORKLOADS.md):
  /// linear warm-up to max_lr, then cosine down to min_lr at the last step.
  double at(int t, int total) const;
};

/// Squared L2 norm of the elements of `grad` where `mask` is true (double precision).
double partial_sq_norm(const torch::Tensor& grad, const torch::Tensor& mask);

/// Global-norm clip factor from the sum of all shards' partial squared norms:
/// min(1, max_norm / (norm + 1e-6)).
double clip_factor(double total_sq_norm, double max_norm);

}  // namespace troupe
