#pragma once
// How a decoder's parameters are split over the T ranks of a tensor-parallel group
// (Megatron-LM's scheme; the collectives its layers use: compute/parallel/tensor_parallel.hpp).
//
//   column-parallel (q, k, v, c_attn, c_fc, gate_proj, up_proj, the output layer): each
//     rank holds 1/T of the output rows (whole heads; gpt2's fused c_attn as three blocks,
//     each rank taking its heads' rows of q, of k and of v);
//   row-parallel (the attention's output projection, the MLP's down projection): each rank
//     holds 1/T of the input columns; its partial sums are added over the group, and a
//     bias is added after that sum;
//   vocab-parallel (the token embedding, an untied lm_head): 1/T of the vocabulary rows;
//   replicated (norms, row-parallel biases, gpt2's positions): every rank holds all of it.
//   With fewer key/value heads than ranks (T a multiple of them), the k and v projections
//   are replicated too, as Megatron replicates the query groups: rank r's query heads all
//   use key/value head r / (T / kv_heads), which it computes from its copy; the copies'
//   gradients, each of the rank's own query heads, are summed over the group.
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <torch/types.h>

#include "compute/models/model_spec.hpp"
#include "compute/models/parameters.hpp"
#include "compute/optim/grad_buffer.hpp"

namespace troupe {

/// Whether `size` ranks replicate the key/value heads of `c` (fewer heads than ranks).
bool replicates_kv_heads(const decoder_config& c, int size);

/// The parameter table by name (rows_by_name) as `size` ranks split it: with replicated
/// key/value heads, the k and v projections (and their biases) are replicated.
std::map<std::string, param_spec> rows_by_name(const model_spec& spec, int size);

/// Rank `rank`'s part of parameter `name` (the whole tensor `full`) when split over `size`
/// ranks (a copy, contiguous).
torch::Tensor shard_parameter(const model_spec& spec, const std::string& name, const torch::Tensor& full, int size,
                              int rank);
/// The same for a parameter split as `split` (its row's tp_split).
torch::Tensor shard_parameter(tp_split split, const torch::Tensor& full, int size, int rank);
/// The whole parameter from its `size` parts in rank order (inverse of shard_parameter).
torch::Tensor unshard_parameter(const model_spec& spec, const std::string& name,
                                const std::vector<torch::Tensor>& parts);
torch::Tensor unshard_parameter(tp_split split, const std::vector<torch::Tensor>& parts);

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

}  // namespace troupe
