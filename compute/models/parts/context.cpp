#include "compute/models/parts/context.hpp"

#include "compute/parallel/tensor_parallel.hpp"

namespace troupe {

torch::Tensor part_context::linear(const torch::Tensor& x, const std::string& name, bool bias) const {
  return troupe::linear(x, param(name + ".weight"), bias ? param(name + ".bias") : torch::Tensor(), defer);
}

torch::Tensor part_context::enter(const torch::Tensor& x) const {
  if (!tp.active()) return x;
  return sequence ? tp::gather_sequence(x, group(), /*reduce_grad=*/true) : tp::copy_to(x, group());
}

torch::Tensor part_context::row_parallel(const torch::Tensor& x, const std::string& name, bool bias) const {
  const auto& b = bias ? param(name + ".bias") : torch::Tensor();
  if (!tp.active()) return troupe::linear(x, param(name + ".weight"), b, defer);
  auto y = troupe::linear(x, param(name + ".weight"), torch::Tensor(), defer);
  y = sequence ? tp::reduce_scatter_sequence(y, group()) : tp::reduce_from(y, group());
  return b.defined() ? y + b : y;
}

collective_group& group_of(const tensor_parallel& tp) {
  if (!tp.group) throw model_error("tensor-parallel rank " + std::to_string(tp.rank) + " computes without a group");
  return *tp.group;
}

collective_group& part_context::group() const { return group_of(tp); }

}  // namespace troupe
