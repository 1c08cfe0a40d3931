#include "compute/models/split_backward.hpp"

#include <torch/autograd.h>
#include <torch/torch.h>

#include "compute/runtime/device.hpp"

namespace troupe {

void weight_grad_store::add(torch::Tensor weight, torch::Tensor input, torch::Tensor grad_output) {
  items_.push_back({std::move(weight), std::move(input), std::move(grad_output)});
}

void weight_grad_store::apply() {
  torch::NoGradGuard no_grad;
  for (auto& it : items_) {
    auto& grad = it.weight.mutable_grad();
    const auto dy = it.grad_output.reshape({-1, it.grad_output.size(-1)});
    const auto x = it.input.reshape({-1, it.input.size(-1)});
    grad.add_(dy.t().mm(x).to(grad.scalar_type()));
  }
  items_.clear();
}

namespace {

/// A linear layer whose backward computes the gradients of its input and bias and leaves
/// the weight's to a weight_grad_store. It computes in the precision autocast would (the
/// cast copies are what it keeps, as autocast's graph would).
struct deferred_linear : torch::autograd::Function<deferred_linear> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& w,
                               const torch::Tensor& b, weight_grad_store* store) {
    const auto dt = current_precision(x.device());
    const auto xc = x.to(dt), wc = w.to(dt);
    ctx->save_for_backward({xc, wc, w});
    ctx->saved_data["store"] = reinterpret_cast<std::int64_t>(store);
    ctx->saved_data["x_dtype"] = std::int64_t(x.scalar_type());
    ctx->saved_data["b_dtype"] = std::int64_t(b.scalar_type());
    return b.numel() > 0 ? torch::linear(xc, wc, b.to(dt)) : torch::linear(xc, wc);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto& dy = grads[0];
    if (!dy.defined()) return {torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
    const auto saved = ctx->get_saved_variables();
    auto dx = dy.matmul(saved[1]).to(torch::ScalarType(ctx->saved_data["x_dtype"].toInt()));
    const bool bias = ctx->needs_input_grad(2);
    auto db = bias ? dy.reshape({-1, dy.size(-1)}).sum(0).to(torch::ScalarType(ctx->saved_data["b_dtype"].toInt()))
                   : torch::Tensor();
    reinterpret_cast<weight_grad_store*>(ctx->saved_data["store"].toInt())->add(saved[2], saved[0], dy);
    return {dx, torch::Tensor(), db, torch::Tensor()};
  }
};

}  // namespace

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b, weight_grad_store* store) {
  // (A custom function's inputs must be defined tensors: no bias is an empty one there.)
  if (store && torch::GradMode::is_enabled())
    return deferred_linear::apply(x, w, b.defined() ? b : torch::empty({0}, w.options().requires_grad(false)), store);
  return torch::linear(x, w, b);
}

}  // namespace troupe
