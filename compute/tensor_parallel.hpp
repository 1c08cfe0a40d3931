#pragma once
// Tensor and sequence parallelism (Megatron-LM's scheme): how a decoder's parameters are
// split over the T ranks of a tensor-parallel group, and the differentiable collectives
// its layers use.
//
//   column-parallel (q, k, v, c_attn, c_fc, gate_proj, up_proj, the output layer): each
//     rank holds 1/T of the output rows (whole heads; gpt2's fused c_attn as three blocks,
//     each rank taking its heads' rows of q, of k and of v);
//   row-parallel (the attention's output projection, the MLP's down projection): each rank
//     holds 1/T of the input columns; its partial sums are added over the group, and a
//     bias is added after that sum;
//   vocab-parallel (the token embedding, an untied lm_head): 1/T of the vocabulary rows;
//   replicated (norms, row-parallel biases, gpt2's positions): every rank holds all of it.
//
// Without sequence parallelism, activations between the layers are whole on every rank:
// f (copy_to) enters a column-parallel layer (identity forward, all-reduce backward), g
// (reduce_from) leaves a row-parallel one (all-reduce forward, identity backward). With it
// (`sequence`), the norms, residuals and embeddings hold seq_len/T positions per rank: the
// sequence is all-gathered entering a column-parallel layer and reduce-scattered leaving a
// row-parallel one, and the replicated parameters' gradients, each rank's share, are
// summed over the group before the update.
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <torch/types.h>

#include "compute/collective_group.hpp"
#include "compute/grad_buffer.hpp"
#include "compute/model.hpp"

namespace troupe {

/// How parameter `name` of `spec` is split (tp_split, model.hpp; a column of the
/// parameters' table in model.cpp).
tp_split tp_split_of(const model_spec& spec, const std::string& name);

/// Rank `rank`'s part of parameter `name` (the whole tensor `full`) when split over `size`
/// ranks (a copy, contiguous).
torch::Tensor shard_parameter(const model_spec& spec, const std::string& name, const torch::Tensor& full, int size,
                              int rank);
/// The whole parameter from its `size` parts in rank order (inverse of shard_parameter).
torch::Tensor unshard_parameter(const model_spec& spec, const std::string& name,
                                const std::vector<torch::Tensor>& parts);

/// Rank `rank` of `size`'s parts of whole tensors by name: parameters ("NAME") and
/// optimizer state ("exp_avg.NAME", "exp_avg_sq.NAME", "main.NAME"; flat or shaped),
/// whose shapes `params` (the whole parameters by name) gives; other keys (a checkpoint's
/// "step") as they are.
std::map<std::string, torch::Tensor> shard_by_name(const model_spec& spec,
                                                   const std::map<std::string, torch::Tensor>& params,
                                                   const std::map<std::string, torch::Tensor>& tensors, int size,
                                                   int rank);
/// The whole parameters' tensors by name from every rank's parts (`parts[t]`: rank t's by
/// parameter name, flat or shaped; of a parameter every rank holds whole, rank 0's).
/// `shapes`: the whole parameters' shapes by name (shaped parts need none). Flat parts
/// give flat wholes.
std::map<std::string, torch::Tensor> unshard_by_name(const model_spec& spec,
                                                     const std::map<std::string, std::vector<std::int64_t>>& shapes,
                                                     const std::vector<std::map<std::string, torch::Tensor>>& parts);

/// The whole model's optimizer state from every rank's (unshard_by_name on each of the
/// moments and the main parameters; `model`: the whole parameters, for their shapes).
named_moments unshard_moments(const model_spec& spec, const state_dict& model, const std::vector<named_moments>& parts);

/// Throws model_error when `spec` cannot be split over `size` ranks (with sequence
/// parallelism: `sequence`), naming the number that does not divide and what would.
void check_tensor_parallel(const model_spec& spec, int size, bool sequence);

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
