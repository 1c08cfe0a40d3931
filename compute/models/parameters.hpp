#pragma once
// A model's parameter table, composed from its family's parts (compute/models/family.hpp):
// the canonical (state_dict) order, initial values, the slices' names, checks of a given
// state_dict, and the experts' shares under expert parallelism.
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "compute/models/model_spec.hpp"
#include "compute/models/parameter.hpp"
#include "compute/models/partition.hpp"

namespace troupe {

/// The full model's parameter table, in canonical (state_dict) order.
param_table all_params(const model_spec& spec);
/// The table's row of parameter `name` (a default one for an unknown name). Builds the
/// whole table: a loop over many names takes rows_by_name once instead.
param_spec spec_of(const model_spec& spec, const std::string& name);
/// The whole table's rows by parameter name.
std::map<std::string, param_spec> rows_by_name(const model_spec& spec);

/// The parameter that the first and the last pipeline stage each hold a copy of (the
/// token embedding, tied to the output layer): "wte.weight" (gpt2),
/// "model.embed_tokens.weight" (llama); "" for untied decoders and the MLP.
std::string tied_parameter(const model_spec& spec);

/// The full model's initial parameters for `seed` (WORKLOADS.md init), canonical order.
state_dict initial_state(const model_spec& spec, std::uint64_t seed);

/// The full model's parameter names in canonical (state_dict) order.
std::vector<std::string> parameter_names(const model_spec& spec);

/// The parameters of the slice for `range` (make_slice), in its order; a last slice of
/// a tied decoder without the embeddings names tied_parameter(spec), its copy of the
/// tied output layer.
std::vector<std::string> slice_parameter_names(const model_spec& spec, const layer_range& range);

/// The expert an expert parameter belongs to ("model.layers.1.block_sparse_moe.experts.3.w1.weight":
/// 3); -1 for every other parameter (the router included).
int expert_of(const std::string& name);

/// The experts a slice holds under expert parallelism (Megatron's expert-data-parallel
/// layout): rank `rank` of `size` holds experts [rank E/size, (rank + 1) E/size) of each
/// expert layer and no other. They come after the dense parameters, in a region of the
/// flat buffers of their own (model_slice::expert_offset), padded to a multiple of
/// `pad_to`: the expert-data-parallel group (the ranks holding the same experts) shards
/// that region, as the data-parallel group shards the dense one. Inactive (size 1): the
/// slice holds every expert, in the model's order, and has no expert region.
struct expert_share {
  int rank = 0;
  int size = 1;
  std::int64_t pad_to = 1;
  bool active() const { return size > 1; }
  /// Whether this rank holds parameter `name` (every parameter but other ranks' experts).
  bool holds(const std::string& name, int n_experts) const;
};

/// The full model's number of parameters (the tied output layer counted once).
std::int64_t parameter_count(const model_spec& spec);

/// Checks that `state` holds exactly the full model's parameters with the right shapes;
/// throws model_error naming every missing, unexpected or mis-shaped entry.
void check_state(const model_spec& spec, const state_dict& state);

/// How parameter `name` of `spec` is split (its row's tp_split).
tp_split tp_split_of(const model_spec& spec, const std::string& name);

}  // namespace troupe
