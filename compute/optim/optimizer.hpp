#pragma once
// Optimizer math on flat fp32 shards: AdamW (Adam with decoupled weight decay) with a
// per-element decay mask, the warm-up + cosine learning-rate schedule and global-norm
// clipping assembled from per-shard partial norms.
#include <cstdint>
#include <vector>

#include <torch/types.h>

#include "compute/optim/adamw_kernel.hpp"

namespace troupe {

struct adamw_options {
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
};

/// AdamW state for one contiguous shard: fp32 main parameters, first and second moments.
/// The update follows torch.optim.AdamW (single-tensor path) element for element; on
/// the CPU it is one fused pass over the shard (split over `threads` threads: the result
/// does not depend on the split), elsewhere a sequence of LibTorch ops.
///
/// Which elements of a shard a per-element rule applies to (weight decay, the gradient
/// norm): on the CPU the mask's runs (a few per parameter, where a bool tensor takes a
/// byte per element: W/4 over the shard group), on another device the bool tensor.
struct shard_mask {
  shard_mask() = default;
  /// From a bool mask (any dtype: nonzero is true): its runs on the CPU, else the tensor.
  explicit shard_mask(const torch::Tensor& mask);
  std::int64_t numel = 0;
  std::vector<kernels::decay_run> runs;  ///< on the CPU
  torch::Tensor tensor;                  ///< on another device (undefined on the CPU)
  /// The mask as a bool tensor on the CPU (the runs expanded) or its device.
  torch::Tensor expanded() const;
};

/// Double-buffered (`double_buffered = true`): the shard holds two copies of its state
/// and each update reads one and writes the other, so the state before the last update
/// stays readable (`previous()`) until the next update, at no copying cost: what the
/// optimizer shard actors keep as their in-memory snapshots for retrying a step.
class adamw_shard {
 public:
  struct state {
    torch::Tensor params, exp_avg, exp_avg_sq;
    std::int64_t steps = 0;
  };

  adamw_shard() = default;
  /// `main_params`: this shard's fp32 parameters (copied); `decay`: bool mask, same size.
  adamw_shard(const torch::Tensor& main_params, const torch::Tensor& decay, adamw_options opts,
              bool double_buffered = false);

  /// One update with this shard's summed gradient `grad`, scaled first by `grad_scale`
  /// (the global clip factor), at learning rate `lr`.
  void step(const torch::Tensor& grad, double lr, double grad_scale = 1.0, int threads = 1);

  const torch::Tensor& params() const { return cur().params; }
  const torch::Tensor& exp_avg() const { return cur().exp_avg; }
  const torch::Tensor& exp_avg_sq() const { return cur().exp_avg_sq; }
  std::int64_t steps() const { return cur().steps; }
  /// The current state (tensors shared, not copied: valid until the update after next
  /// when double-buffered, until the next update otherwise).
  const state& current() const { return cur(); }
  /// Double-buffered: the state before the last update (or the current one when there
  /// was none since construction); valid until the next update.
  const state& previous() const { return banks_[prev_]; }
  /// Double-buffered: frees the state before the last update (its tensors, where nothing
  /// else holds them; previous() is then the current state). The next update makes
  /// the bank it writes afresh: between a step's commit and the next update a shard
  /// holds one copy of its state.
  void release_previous();
  /// Overwrites the current state (restoring a snapshot).
  void assign(const state& from);
  /// For restoring a checkpoint (tensors are filled in place through the accessors).
  void set_steps(std::int64_t steps) { banks_[cur_].steps = steps; }
  const adamw_options& options() const { return opts_; }

 private:
  const state& cur() const { return banks_[cur_]; }
  adamw_options opts_;
  state banks_[2];
  int cur_ = 0, prev_ = 0;
  bool double_buffered_ = false;
  shard_mask decay_;
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

/// Squared L2 norm of the elements of `grad` where `mask` is true (double precision; on
/// the CPU in one pass with a fixed summation order).
double partial_sq_norm(const torch::Tensor& grad, const torch::Tensor& mask);
/// The same with a shard_mask (the CPU: over its runs, the same bits).
double partial_sq_norm(const torch::Tensor& grad, const shard_mask& mask);

/// Global-norm clip factor from the sum of all shards' partial squared norms:
/// min(1, max_norm / (norm + 1e-6)).
double clip_factor(double total_sq_norm, double max_norm);

}  // namespace troupe
