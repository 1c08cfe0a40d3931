#include "compute/parallel/tensor_parallel.hpp"

#include <stdexcept>
#include <string>

#include <torch/autograd.h>

namespace troupe {

namespace tp {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

collective_group& group_of(AutogradContext* ctx) {
  return *reinterpret_cast<collective_group*>(ctx->saved_data["group"].toInt());
}
std::int64_t handle(collective_group& g) { return reinterpret_cast<std::int64_t>(&g); }

/// Reduced precisions are summed in fp32 (the transports sum fp32 and fp64).
bool summed_in_fp32(const torch::Tensor& x) {
  return x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kHalf;
}

/// The sum over the group of `x` (a new tensor).
torch::Tensor summed(const torch::Tensor& x, collective_group& g) {
  const bool low = summed_in_fp32(x);
  auto y = low ? x.to(torch::kFloat32).contiguous() : x.contiguous().clone();
  g.all_reduce(y);
  return low ? y.to(x.scalar_type()) : y;
}

/// Every rank's `x` concatenated along `dim`.
torch::Tensor gathered(const torch::Tensor& x, std::int64_t dim, collective_group& g) {
  const auto front = x.movedim(dim, 0).contiguous();
  auto sizes = front.sizes().vec();
  sizes[0] *= g.size();
  auto out = torch::empty(sizes, front.options());
  g.all_gather(front, out);
  return out.movedim(0, dim);
}

/// This rank's part along `dim` of the sum over the group.
torch::Tensor reduce_scattered(const torch::Tensor& x, std::int64_t dim, collective_group& g) {
  const auto front = x.movedim(dim, 0).to(summed_in_fp32(x) ? torch::kFloat32 : x.scalar_type()).contiguous();
  auto sizes = front.sizes().vec();
  if (sizes[0] % g.size() != 0)
    throw std::invalid_argument("a reduce-scatter of " + std::to_string(sizes[0]) + " positions over " +
                      std::to_string(g.size()) + " ranks");
  sizes[0] /= g.size();
  auto out = torch::empty(sizes, front.options());
  g.reduce_scatter(front, out);
  return out.to(x.scalar_type()).movedim(0, dim);
}

torch::Tensor own_part(const torch::Tensor& x, std::int64_t dim, collective_group& g) {
  const auto n = x.size(dim) / g.size();
  return x.narrow(dim, n * g.rank(), n);
}

struct copy_to_fn : torch::autograd::Function<copy_to_fn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, std::int64_t g) {
    ctx->saved_data["group"] = g;
    return x;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {summed(grads[0], group_of(ctx)), torch::Tensor()};
  }
};

struct reduce_from_fn : torch::autograd::Function<reduce_from_fn> {
  static torch::Tensor forward(AutogradContext*, const torch::Tensor& x, std::int64_t g) {
    return summed(x, *reinterpret_cast<collective_group*>(g));
  }
  static variable_list backward(AutogradContext*, variable_list grads) { return {grads[0], torch::Tensor()}; }
};

struct gather_sequence_fn : torch::autograd::Function<gather_sequence_fn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, std::int64_t g, bool reduce_grad) {
    ctx->saved_data["group"] = g;
    ctx->saved_data["reduce"] = reduce_grad;
    return gathered(x, 1, *reinterpret_cast<collective_group*>(g));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto& g = group_of(ctx);
    auto dx = ctx->saved_data["reduce"].toBool() ? reduce_scattered(grads[0], 1, g) : own_part(grads[0], 1, g);
    return {dx, torch::Tensor(), torch::Tensor()};
  }
};

struct reduce_scatter_sequence_fn : torch::autograd::Function<reduce_scatter_sequence_fn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, std::int64_t g) {
    ctx->saved_data["group"] = g;
    return reduce_scattered(x, 1, *reinterpret_cast<collective_group*>(g));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {gathered(grads[0], 1, group_of(ctx)), torch::Tensor()};
  }
};

struct scatter_sequence_fn : torch::autograd::Function<scatter_sequence_fn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, std::int64_t g) {
    ctx->saved_data["group"] = g;
    return own_part(x, 1, *reinterpret_cast<collective_group*>(g)).contiguous();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {gathered(grads[0], 1, group_of(ctx)), torch::Tensor()};
  }
};

struct cross_entropy_fn : torch::autograd::Function<cross_entropy_fn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& logits, const torch::Tensor& target,
                               std::int64_t first, std::int64_t handle) {
    auto& g = *reinterpret_cast<collective_group*>(handle);
    const auto n = logits.size(0), width = logits.size(1);
    // The row maxima of the whole vocabulary: every rank's, gathered (the transports sum only).
    auto local_max = std::get<0>(logits.max(1)).contiguous();
    auto maxima = torch::empty({g.size() * n}, local_max.options());
    g.all_gather(local_max, maxima);
    const auto row_max = std::get<0>(maxima.view({g.size(), n}).max(0));
    const auto shifted = logits - row_max.unsqueeze(1);
    const auto outside = (target < first).logical_or(target >= first + width);
    const auto local = (target - first).masked_fill(outside, 0);
    auto exp = shifted.exp();
    // The target's logit (from the rank holding it) and the sum of exponentials, in one sum.
    auto sums = torch::stack({shifted.gather(1, local.unsqueeze(1)).squeeze(1).masked_fill(outside, 0.0),
                              exp.sum(1)})
                    .contiguous();
    g.all_reduce(sums);
    const auto sum_exp = sums[1];
    exp.div_(sum_exp.unsqueeze(1));  // the softmax, kept for the backward
    ctx->save_for_backward({exp, local, outside});
    return (sum_exp.log() - sums[0]).mean();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto d = saved[0].clone();
    const auto inside = saved[2].logical_not().to(d.scalar_type());
    d.scatter_add_(1, saved[1].unsqueeze(1), -inside.unsqueeze(1));
    d.mul_(grads[0] / double(d.size(0)));
    return {d, torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor copy_to(const torch::Tensor& x, collective_group& g) { return copy_to_fn::apply(x, handle(g)); }
torch::Tensor reduce_from(const torch::Tensor& x, collective_group& g) { return reduce_from_fn::apply(x, handle(g)); }
torch::Tensor gather_sequence(const torch::Tensor& x, collective_group& g, bool reduce_grad) {
  return gather_sequence_fn::apply(x, handle(g), reduce_grad);
}
torch::Tensor reduce_scatter_sequence(const torch::Tensor& x, collective_group& g) {
  return reduce_scatter_sequence_fn::apply(x, handle(g));
}
torch::Tensor scatter_sequence(const torch::Tensor& x, collective_group& g) {
  return scatter_sequence_fn::apply(x, handle(g));
}

torch::Tensor vocab_embedding(const torch::Tensor& ids, const torch::Tensor& weight, std::int64_t first) {
  const auto outside = (ids < first).logical_or(ids >= first + weight.size(0));
  const auto e = torch::embedding(weight, (ids - first).masked_fill(outside, 0));
  return e.masked_fill(outside.unsqueeze(-1), 0.0);
}

torch::Tensor vocab_cross_entropy(const torch::Tensor& logits, const torch::Tensor& target, std::int64_t first,
                                  collective_group& g) {
  return cross_entropy_fn::apply(logits.reshape({-1, logits.size(-1)}), target.reshape({-1}), first, handle(g));
}

torch::Tensor gather_dim(const torch::Tensor& x, int64_t dim, collective_group& g) {
  torch::NoGradGuard no_grad;
  return gathered(x, dim < 0 ? dim + x.dim() : dim, g);
}

}  // namespace tp

}  // namespace troupe
