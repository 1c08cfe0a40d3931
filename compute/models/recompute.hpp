#pragma once
// Activation recomputation wraps parts; the parts know nothing of it.
//   full (Megatron's full recompute, one block per checkpoint): a block's forward runs
//     without a graph and keeps only its input; the backward runs the block again with a
//     graph, under the precision the forward ran in, and back-propagates through it.
//   selective (Megatron's selective recompute): the attention core keeps only q, k and v
//     and runs again in the backward.
// Gradients are bit-identical to those without it.
#include <cstdint>

#include <torch/types.h>

#include "compute/models/parts/attention.hpp"
#include "compute/models/parts/context.hpp"
#include "compute/models/split_backward.hpp"

namespace troupe {

/// What a full recompute runs again: a slice's blocks.
class block_runner {
 public:
  virtual ~block_runner() = default;
  /// Block i of the slice on x, run as `pass` says, attending by the window's `documents`.
  virtual torch::Tensor run_block(const torch::Tensor& x, int i, block_pass pass, const window_documents& documents) = 0;
  /// The split backward's store the slice's projections use now (the rerun in the
  /// backward uses the one its forward deferred into).
  virtual weight_grad_store*& deferral() = 0;
};

/// Block i of `runner` with its activations recomputed in the backward (a reentrant
/// checkpoint, as torch.utils.checkpoint's): the parameters' gradients accumulate as
/// usual, the input's gradient is returned. `x` must require a gradient. The rerun
/// attends by the same `documents` (kept with the graph: a slice may run another
/// micro-batch's forward meanwhile, on another thread too).
torch::Tensor recomputed_block(const torch::Tensor& x, block_runner& runner, int i, const window_documents& documents);

/// `core` (with no cached keys, with `mask` when defined) keeping only q, k and v, run
/// again in the backward. The core must outlive the backward.
torch::Tensor recomputed_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                   const causal_attention& core, const torch::Tensor& mask = {});

/// Blocks (full) and attention cores (selective) run again in backwards so far, by every
/// slice of this process.
std::int64_t blocks_recomputed();
std::int64_t attentions_recomputed();

}  // namespace troupe
