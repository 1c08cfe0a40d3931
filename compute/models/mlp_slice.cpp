#include "compute/models/mlp_slice.hpp"

#include <string>

#include <torch/nn/functional.h>
#include <torch/torch.h>

namespace F = torch::nn::functional;

namespace troupe {

mlp_slice::mlp_slice(const model_spec& spec, const layer_range& range, const state_dict& state, std::int64_t pad_to,
                     torch::Device device, torch::ScalarType param_dtype)
    : n_layers_(spec.n_layers()) {
  range_ = range;
  allocate(spec, state, slice_parameter_names(spec, range), {}, pad_to, device, param_dtype, {});
}

torch::Tensor mlp_slice::forward(const torch::Tensor& input, const torch::Tensor& /*positions: no attention*/) {
  torch::Tensor x = input;
  for (int i = range_.first; i < range_.last; ++i) {
    const std::string p = "net." + std::to_string(2 * i) + ".";
    x = linear_layer(x, param(p + "weight"), param(p + "bias"));
    if (i + 1 < n_layers_) x = torch::relu(x);
  }
  return x;
}

torch::Tensor mlp_slice::loss(const torch::Tensor& output, const torch::Tensor& target) {
  return F::cross_entropy(output, target);
}

}  // namespace troupe
