#include "compute/models/parts/norm.hpp"

#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/torch.h>

namespace troupe {

param_table norm_params(norm_kind kind, const std::string& name, std::int64_t width) {
  using I = param_spec::init;
  if (kind == norm_kind::rms_norm) return {{name + ".weight", {width}, I::ones}};
  return {{name + ".weight", {width}, I::ones}, {name + ".bias", {width}, I::zeros}};
}

namespace {

torch::Tensor layer_norm(const part_context& c, const torch::Tensor& x, const std::string& p) {
  const auto& w = c.param(p + ".weight");
  const auto& b = c.param(p + ".bias");
  if (x.scalar_type() == torch::kFloat32) return torch::layer_norm(x, {c.cfg.d_model}, w, b, c.cfg.norm_eps);
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  return torch::layer_norm(x, {c.cfg.d_model}, w.to(x.scalar_type()), b.to(x.scalar_type()), c.cfg.norm_eps);
}

}  // namespace

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  const auto xf = x.to(torch::kFloat32);
  const auto normed = xf * torch::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return weight.to(x.scalar_type()) * normed.to(x.scalar_type());
}

torch::Tensor norm(const part_context& c, const torch::Tensor& x, const std::string& name) {
  return c.family.norm == norm_kind::rms_norm ? rms_norm(x, c.param(name + ".weight"), c.cfg.norm_eps)
                                              : layer_norm(c, x, name);
}

}  // namespace troupe
