#include "compute/models/parts/positions.hpp"

#include <cmath>

#include <torch/torch.h>

namespace troupe {

param_table learned_position_params(const std::string& name, std::int64_t positions, std::int64_t width) {
  return {{name, {positions, width}, param_spec::init::normal, 0.02, false}};
}

torch::Tensor add_learned_positions(const torch::Tensor& x, const torch::Tensor& table, std::int64_t from,
                                    torch::Device device, const torch::Tensor& positions) {
  if (positions.defined()) return x + torch::embedding(table, positions.to(device));
  auto pos = torch::arange(from, from + x.size(1), torch::TensorOptions().dtype(torch::kInt64).device(device));
  return x + torch::embedding(table, pos);
}

rotary_embedding::rotary_embedding(const decoder_config& cfg, torch::Device device) {
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
  const std::int64_t hd = cfg.head_dim();
  auto inv_freq =
      torch::reciprocal(torch::pow(cfg.rope_theta, torch::arange(0, hd, 2, f32.dtype(torch::kInt64)).to(torch::kFloat32) / hd));
  const auto& r = cfg.rope;
  if (r.type == rope_scaling::kind::linear) {
    inv_freq = inv_freq / r.factor;
  } else if (r.type == rope_scaling::kind::llama3) {
    // Llama 3.1's (Hugging Face's _compute_llama3_parameters): wavelengths above
    // original / low_freq_factor divided by factor, below original / high_freq_factor
    // kept, and those between interpolated.
    const double low_wavelen = r.original_positions / r.low_freq_factor;
    const double high_wavelen = r.original_positions / r.high_freq_factor;
    const auto wavelen = 2 * M_PI / inv_freq;
    auto scaled = torch::where(wavelen > low_wavelen, inv_freq / r.factor, inv_freq);
    const auto smooth = (r.original_positions / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
    const auto smoothed = (1 - smooth) * scaled / r.factor + smooth * scaled;
    const auto medium = wavelen.ge(high_wavelen).logical_and(wavelen.le(low_wavelen));
    inv_freq = torch::where(medium, smoothed, scaled);
  }
  const auto angles =
      torch::arange(0, cfg.seq_len, f32.dtype(torch::kInt64)).to(torch::kFloat32).unsqueeze(1) * inv_freq.unsqueeze(0);
  const auto emb = torch::cat({angles, angles}, /*dim=*/1);
  cos_ = emb.cos().to(device);
  sin_ = emb.sin().to(device);
}

torch::Tensor rotary_embedding::rotate(const torch::Tensor& x, std::int64_t from, const torch::Tensor& positions) const {
  const auto T = x.size(2), half = x.size(3) / 2;
  // Documents: each sequence's rows of the tables, (B, 1, T, hd) over the heads.
  const auto rows = [&](const torch::Tensor& table) {
    return positions.defined() ? table.index_select(0, positions.reshape({-1})).view({positions.size(0), 1, T, -1})
                               : table.narrow(0, from, T);
  };
  const auto cos = rows(cos_).to(x.scalar_type());
  const auto sin = rows(sin_).to(x.scalar_type());
  const auto rotated = torch::cat({-x.narrow(3, half, half), x.narrow(3, 0, half)}, /*dim=*/3);
  return x * cos + rotated * sin;
}

}  // namespace troupe
