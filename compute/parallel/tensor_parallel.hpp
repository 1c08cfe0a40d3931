#pragma once
// Tensor and sequence parallelism (Megatron-LM's scheme): the differentiable collectives
// the layers of a tensor-parallel group use (how the parameters are split:
// compute/models/tensor_parallel_layout.hpp).
//
// Without sequence parallelism, activations between the layers are whole on every rank:
// f (copy_to) enters a column-parallel layer (identity forward, all-reduce backward), g
// (reduce_from) leaves a row-parallel one (all-reduce forward, identity backward). With it
// (`sequence`), the norms, residuals and embeddings hold seq_len/T positions per rank: the
// sequence is all-gathered entering a column-parallel layer and reduce-scattered leaving a
// row-parallel one, and the replicated parameters' gradients, each rank's share, are
// summed over the group before the update.
#include <cstdint>

#include <torch/types.h>

#include "compute/parallel/collective_group.hpp"

namespace troupe {

/// Differentiable collectives over a tensor-parallel group (the sequence is dimension 1
/// of (batch, sequence, features) activations).
namespace tp {
/// f: identity forward, all-reduce of the gradient backward.
torch::Tensor copy_to(const torch::Tensor& x, collective_group& g);
/// g: all-reduce forward, identity backward.
torch::Tensor reduce_from(const torch::Tensor& x, collective_group& g);
/// Sequence parallelism, entering a column-parallel layer: all-gather of the sequence
/// forward; backward a reduce-scatter (each rank's layer adds its own share of the
/// gradient) when `reduce_grad`, else this rank's positions of a gradient every rank holds
/// whole (leaving a stage: the next stage hands every rank the same gradient).
torch::Tensor gather_sequence(const torch::Tensor& x, collective_group& g, bool reduce_grad);
/// Sequence parallelism, leaving a row-parallel layer: reduce-scatter of the sequence
/// forward, all-gather backward.
torch::Tensor reduce_scatter_sequence(const torch::Tensor& x, collective_group& g);
/// Sequence parallelism, entering a stage: this rank's positions forward, all-gather of
/// the gradient backward.
torch::Tensor scatter_sequence(const torch::Tensor& x, collective_group& g);
/// Vocab-parallel embedding: `weight` holds rows [first, first + weight.size(0)) of the
/// vocabulary; ids outside them give zeros. The partial embeddings still need a sum
/// over the group (reduce_from, or reduce_scatter_sequence).
torch::Tensor vocab_embedding(const torch::Tensor& ids, const torch::Tensor& weight, std::int64_t first);
/// Vocab-parallel cross-entropy, the mean over every target: `logits` (..., V/T) are this
/// rank's columns [first, first + V/T) of the logits (fp32); the max, the target logit and
/// the sum of exponentials are all-reduced (the max as an all-gather of every rank's), the
/// backward needs no communication. Columns holding minus infinity (padding) stay out.
torch::Tensor vocab_cross_entropy(const torch::Tensor& logits, const torch::Tensor& target, std::int64_t first,
                                  collective_group& g);
/// The whole of dimension `dim` from every rank's part (no gradient: logits for
/// evaluation and generation).
torch::Tensor gather_dim(const torch::Tensor& x, int64_t dim, collective_group& g);
}  // namespace tp

}  // namespace troupe
