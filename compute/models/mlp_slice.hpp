#pragma once
// WORKLOADS.md "fmnist-mlp": a slice of the MLP's Linear layers (ReLU between them).
#include <cstdint>

#include <torch/types.h>

#include "compute/models/model_slice.hpp"

namespace troupe {

class mlp_slice final : public model_slice {
 public:
  mlp_slice(const model_spec& spec, const layer_range& range, const state_dict& state,
            std::int64_t pad_to, torch::Device device, torch::ScalarType param_dtype);

  torch::Tensor forward(const torch::Tensor& input, const torch::Tensor& positions = {}) override;
  torch::Tensor logits(const torch::Tensor& output) override { return output; }
  torch::Tensor loss(const torch::Tensor& output, const torch::Tensor& target) override;

 private:
  int n_layers_;
};

}  // namespace troupe
