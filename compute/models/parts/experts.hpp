#pragma once
// Experts (WORKLOADS.md "moe-tiny", Mixtral's sparse MLP): the router, the top-k choice,
// the capacity factor's dropping, the experts' SwiGLU MLPs on the tokens that chose them
// (here, or dispatched over an expert-parallel group: compute/parallel/expert_parallel.hpp),
// and the load-balancing loss.
#include <cstdint>
#include <map>
#include <string>

#include <torch/types.h>

#include "compute/models/family.hpp"
#include "compute/models/parameter.hpp"
#include "compute/models/parts/context.hpp"
#include "compute/parallel/collective_group.hpp"

namespace troupe {

/// The router's and every expert's parameters in block `block` ("model.layers.0.").
param_table expert_params(const decoder_family& f, const decoder_config& c, const std::string& block);

/// What a slice's expert layers add up over its forwards (model_slice::take_aux_loss,
/// take_expert_tokens), and how they compute.
struct expert_tally {
  const expert_parallel& ep;  ///< an active group: this rank computes only its experts
  double aux_scale = 1.0;     ///< the weight of the micro-batch's loss (model_slice::set_aux_loss_scale)
  torch::Tensor& aux_sum;     ///< the load-balancing loss times aux_scale, undefined when none was added
  std::map<int, torch::Tensor>& tokens;  ///< per layer: pairs per expert, then those dropped
};

/// The sparse MLP of block `layer` (prefix `block`) on g (B, T, d): per token the router's
/// softmax in fp32 over every expert; the top_k largest (ties: the lower index, a stable
/// sort) with weights renormalised to sum 1; no token dropped unless a capacity factor is
/// set (then in training only). A training forward counts its load-balancing loss once
/// (not when a full recompute runs the block again) and, with a graph, back-propagates it
/// where the block's output leaves.
torch::Tensor experts(const part_context& c, const torch::Tensor& g, const std::string& block, int layer,
                      expert_tally& tally);

}  // namespace troupe
