#include "compute/models/parts/mlp.hpp"

#include <cmath>

#include <torch/torch.h>

namespace troupe {

param_table mlp_params(const decoder_family& f, const decoder_config& c, const std::string& block) {
  const std::string p = block + f.mlp.prefix;
  const std::int64_t d = c.d_model, w = c.d_ff;
  const double proj_std = 0.02 / std::sqrt(2.0 * c.n_layer);
  using I = param_spec::init;
  using S = tp_split;
  const bool bias = f.mlp.bias;
  param_table out;
  auto column = [&](const std::string& name) {
    out.push_back({p + name + ".weight", {w, d}, I::normal, 0.02, true, S::rows});
    if (bias) out.push_back({p + name + ".bias", {w}, I::zeros, 0, false, S::rows});
  };
  if (f.mlp.kind == mlp_kind::swiglu) column(f.mlp.gate);
  column(f.mlp.up);
  out.push_back({p + f.mlp.down + ".weight", {d, w}, I::normal, proj_std, true, S::columns});
  if (bias) out.push_back({p + f.mlp.down + ".bias", {d}, I::zeros});
  return out;
}

torch::Tensor mlp(const part_context& c, const torch::Tensor& x, const std::string& block) {
  const auto& o = c.family.mlp;
  const std::string p = block + o.prefix;
  if (o.kind == mlp_kind::gelu) {
    auto h = torch::gelu(c.linear(c.enter(x), p + o.up, o.bias), c.cfg.gelu_tanh ? "tanh" : "none");
    return c.row_parallel(h, p + o.down, o.bias);
  }
  const auto g = c.enter(x);
  const auto h = torch::silu(c.linear(g, p + o.gate, o.bias)) * c.linear(g, p + o.up, o.bias);
  return c.row_parallel(h, p + o.down, o.bias);
}

}  // namespace troupe
