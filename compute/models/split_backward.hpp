#pragma once
// The split backward of the zero-bubble schedules: a linear layer whose backward computes
// its input's and bias's gradients and leaves its weight's to a store, applied later (the
// W op). It wraps the parts' projections; the parts know nothing of it.
#include <cstddef>
#include <vector>

#include <torch/types.h>

namespace troupe {

/// Weight gradients a split backward left for later (the zero-bubble schedules' W op):
/// per linear layer, the weight, the layer's input and its output's gradient (in the
/// precision the layer computed in).
class weight_grad_store {
 public:
  /// Adds grad_output^T input (over all leading dimensions) to each weight's gradient,
  /// in fp32 like the autograd's accumulation, and forgets them.
  void apply();
  bool empty() const { return items_.empty(); }
  std::size_t size() const { return items_.size(); }
  void clear() { items_.clear(); }
  /// A deferring layer's backward.
  void add(torch::Tensor weight, torch::Tensor input, torch::Tensor grad_output);

 private:
  struct item {
    torch::Tensor weight, input, grad_output;
  };
  std::vector<item> items_;
};

/// x w^T + b (no bias: an undefined `b`); with a `store` and a graph being built, the
/// weight's gradient is left to `store` (computed in the precision autocast would use).
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b, weight_grad_store* store);

}  // namespace troupe
