#pragma once
// One pipeline replica in one process: p stages x v chunks of model slices, run in a
// schedule's order with tensors handed over in memory. This is the plain-LibTorch
// reference that the actor runtime is checked against.
#include <memory>
#include <vector>

#include "compute/data/data.hpp"
#include "compute/models/model.hpp"
#include "compute/schedule/schedule.hpp"

namespace troupe {

class local_pipeline {
 public:
  /// `split`: explicit layer counts per virtual stage (empty: even split);
  /// `pad_to`: flat buffers padded to a multiple of this (data-parallel width); `tp`:
  /// the pipeline of one tensor-parallel rank (its slices hold that rank's parts; the
  /// group's pipelines each run on a thread of their own, in the same order); `experts`:
  /// the experts its slices hold (expert_share).
  local_pipeline(const model_spec& spec, const state_dict& init, int stages, int chunks = 1,
                 const std::vector<int>& split = {}, std::int64_t pad_to = 1,
                 torch::Device device = torch::kCPU, const tensor_parallel& tp = {},
                 const expert_share& experts = {});

  int stages() const { return stages_; }
  int chunks() const { return chunks_; }
  int virtual_stages() const { return int(slices_.size()); }
  model_slice& slice(int virtual_stage) { return *slices_.at(virtual_stage); }
  const model_spec& spec() const { return spec_; }

  /// Runs one step's forwards and backwards: each stage follows its order in `sched`,
  /// an op runs once its input (activation or gradient) exists. Gradients accumulate
  /// into the slices' grad buffers; each micro-batch's loss is multiplied by
  /// `loss_weight` before its backward. Returns every micro-batch's (unweighted) loss.
  /// Throws schedule_error if the schedule cannot make progress.
  std::vector<double> run_step(const schedule& sched, const std::vector<batch>& microbatches,
                               double loss_weight);

  /// Sums the gradients of the two copies of the tied embedding (first and last
  /// stage) into both, as Megatron's embedding-group all-reduce does.
  void sum_tied_grads();
  void zero_grads();
  /// The load-balancing loss of the forwards since the last call (see model_slice).
  double take_aux_loss();
  /// The choices per expert of those forwards, summed over the slices (see model_slice).
  expert_counts take_expert_tokens();

  /// Forward through every slice without autograd; returns the last slice's output.
  /// `positions`: the documents of the windows (model_slice::forward).
  torch::Tensor forward(const torch::Tensor& input, const torch::Tensor& positions = {});

  /// Full-model parameters (each once, canonical order), cloned. Tensor parallelism:
  /// this rank's parts of them (unshard_state puts the ranks' together); sharded experts:
  /// this rank's experts only.
  state_dict state() const;

 private:
  model_spec spec_;
  int stages_, chunks_;
  expert_share experts_;
  std::vector<std::unique_ptr<model_slice>> slices_;
};

}  // namespace troupe
