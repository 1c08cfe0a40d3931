#pragma once
// Norms: LayerNorm (weight and bias) and RMSNorm (a weight), over the model's width.
#include <cstdint>
#include <string>

#include <torch/types.h>

#include "compute/models/family.hpp"
#include "compute/models/parameter.hpp"
#include "compute/models/parts/context.hpp"

namespace troupe {

/// The parameters of the norm `name` ("h.0.ln_1") of `width`: weight (ones) and, for a
/// LayerNorm, bias (zeros); every tensor-parallel rank holds them whole.
param_table norm_params(norm_kind kind, const std::string& name, std::int64_t width);

/// The family's norm `name` of x (..., d_model).
///   LayerNorm: in fp32 for an fp32 x (autocast's choice); on a bf16 residual stream in its
///     dtype (the kernel's statistics in fp32), with its weights as bf16 values.
///   RMSNorm, as Hugging Face computes it: the statistics in fp32, then the weight times the
///     normalised input in the input's dtype.
torch::Tensor norm(const part_context& c, const torch::Tensor& x, const std::string& name);

/// RMSNorm of x over its last dimension with `weight`, as Hugging Face computes it.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);

}  // namespace troupe
