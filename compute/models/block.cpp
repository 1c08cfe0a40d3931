#include "compute/models/block.hpp"

#include "compute/models/parts/mlp.hpp"
#include "compute/models/parts/norm.hpp"

namespace troupe {

param_table block_params(const decoder_family& f, const decoder_config& c, int i) {
  const std::string p = f.block(i);
  param_table out;
  auto append = [&](param_table v) { out.insert(out.end(), v.begin(), v.end()); };
  append(norm_params(f.norm, p + f.attention_norm, c.d_model));
  append(attention_params(f, c, p));
  append(norm_params(f.norm, p + f.mlp_norm, c.d_model));
  append(c.is_moe_block(i) ? expert_params(f, c, p) : mlp_params(f, c, p));
  return out;
}

torch::Tensor decoder_block(const part_context& c, torch::Tensor x, int i, kv_cache* cache, int cache_index,
                            const block_parts& parts) {
  const auto& f = c.family;
  const std::string p = f.block(i);
  x = x + attention(c, norm(c, x, p + f.attention_norm), p, cache, cache_index, parts.core, parts.rotary,
                    parts.positions);
  if (c.cfg.is_moe_block(i)) {
    // The experts compute on this rank's tokens, not split (expert tensor parallelism 1):
    // under sequence parallelism its part of the sequences, so nothing is gathered.
    return x + experts(c, norm(c, x, p + f.mlp_norm), p, i, parts.experts).to(x.scalar_type());
  }
  return x + mlp(c, norm(c, x, p + f.mlp_norm), p);
}

}  // namespace troupe
