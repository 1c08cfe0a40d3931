#pragma once
// The models as their users see them: which model (model_spec.hpp), its parameter table
// (parameters.hpp), and the slices a pipeline stage holds (model_slice.hpp). A decoder is
// composed of parts (compute/models/parts/) as its family's table says (family.hpp).
#include "compute/models/model_slice.hpp"
#include "compute/models/model_spec.hpp"
#include "compute/models/parameters.hpp"

#include <cstdint>
#include <memory>

#include <torch/types.h>

namespace troupe {

/// Builds the slice for `range`, taking its parameters from a full-model `state`.
/// `pad_to`: flat buffers are padded to a multiple of this (the data-parallel width);
/// `device`: where the buffers (and the computation) live; `param_dtype`: fp32, or bf16
/// (the parameters are `state`'s rounded to bf16; see model_slice). `tp`: the slice's
/// rank in a tensor-parallel group (decoders): it holds that rank's part of each parameter
/// (compute/models/tensor_parallel_layout.hpp; the names stay the whole model's), and its forward and
/// backward run the group's collectives (a `tp` without a group: a slice that only lays
/// out the rank's part, for optimizer shards). The parameters every rank holds whole are
/// shared copies on ranks other than 0 (counted once in the grad norm, saved once).
/// `experts`: the experts the slice holds (expert_share; the experts are whole on every
/// tensor-parallel rank and no shared copies: each expert-data-parallel group holds its own).
std::unique_ptr<model_slice> make_slice(const model_spec& spec, const layer_range& range,
                                        const state_dict& state, std::int64_t pad_to = 1,
                                        torch::Device device = torch::kCPU,
                                        torch::ScalarType param_dtype = torch::kFloat32,
                                        const tensor_parallel& tp = {}, const expert_share& experts = {});

}  // namespace troupe
