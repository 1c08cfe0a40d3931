#include "compute/optimizer.hpp"

#include <cmath>

namespace troupe {

adamw_shard::adamw_shard(const torch::Tensor& main_params, const torch::Tensor& decay,
                         adamw_options opts)
    : opts_(opts),
      params_(main_params.detach().to(torch::kFloat32).clone()),
      exp_avg_(torch::zeros_like(params_)),
      exp_avg_sq_(torch::zeros_like(params_)),
      decay_(decay.to(torch::kBool)) {}

void adamw_shard::step(const torch::Tensor& grad_in, double lr, double grad_scale) {
  torch::NoGradGuard no_grad;
  ++steps_;
  torch::Tensor grad = grad_scale == 1.0 ? grad_in : grad_in * grad_scale;
  // Decoupled weight decay only where the mask says so: p *= 1 - lr * wd.
  if (opts_.weight_decay != 0.0) {
    const auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
    const auto factor = torch::where(decay_, torch::scalar_tensor(1.0 - lr * opts_.weight_decay, f32),
                                     torch::scalar_tensor(1.0, f32));
    params_.mul_(factor);
  }
  exp_avg_.mul_(opts_.beta1).add_(grad, 1.0 - opts_.beta1);
  exp_avg_sq_.mul_(opts_.beta2).addcmul_(grad, grad, 1.0 - opts_.beta2);
  const double bias_correction1 = 1.0 - std::pow(opts_.beta1, double(steps_));
  const double bias_correction2 = 1.0 - std::pow(opts_.beta2, double(steps_));
  const double step_size = lr / bias_correction1;
  auto denom = (exp_avg_sq_.sqrt() / std::sqrt(bias_correction2)).add_(opts_.eps);
  params_.addcdiv_(exp_avg_, denom, -step_size);
}

double lr_schedule::at(int t, int total) const {
  if (t < warmup) return max_lr * double(t + 1) / double(warmup);
  const double span = std::max(1, total - 1 - warmup);
  return min_lr + 0.5 * (max_lr - min_lr) * (1.0 + std::cos(M_PI * double(t - warmup) / span));
}

double partial_sq_norm(const torch::Tensor& grad, const torch::Tensor& mask) {
  auto g = grad.masked_select(mask).to(torch::kFloat64);
  return g.dot(g).item<double>();
}

double clip_factor(double total_sq_norm, double max_norm) {
  return std::min(1.0, max_norm / (std::sqrt(total_sq_norm) + 1e-6));
}

}  // namespace troupe
