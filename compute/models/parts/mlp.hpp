#pragma once
// The dense MLP of a block: GELU (up, exact GELU, down) or SwiGLU (down(silu(gate(x)) *
// up(x))). Under tensor parallelism the first projections are column-parallel, the last
// row-parallel.
#include <string>

#include <torch/types.h>

#include "compute/models/family.hpp"
#include "compute/models/parameter.hpp"
#include "compute/models/parts/context.hpp"

namespace troupe {

/// The MLP's parameters in block `block` ("h.0."), in the family's order.
param_table mlp_params(const decoder_family& f, const decoder_config& c, const std::string& block);

/// The MLP of block `block` on `x` (its normed input, (B, T, d)): what the residual adds.
torch::Tensor mlp(const part_context& c, const torch::Tensor& x, const std::string& block);

}  // namespace troupe
