#pragma once
// A decoder block, composed of parts as its family's table says:
//   h = x + attention(norm_1(x)),  then  h + mlp(norm_2(h))  (or the experts' sparse MLP).
#include <string>

#include <torch/types.h>

#include "compute/models/kv_cache.hpp"
#include "compute/models/parameter.hpp"
#include "compute/models/parts/attention.hpp"
#include "compute/models/parts/context.hpp"
#include "compute/models/parts/experts.hpp"
#include "compute/models/parts/positions.hpp"

namespace troupe {

/// The parameters of block i, in canonical order: its norms, attention, MLP or experts.
param_table block_params(const decoder_family& f, const decoder_config& c, int i);

/// What a block computes with besides its context: the attention's core and the family's
/// rotary embedding (nullptr: learned positions), what its experts add up, and the
/// tokens' positions (documents: (B, T) int64; undefined: 0, 1, ...).
struct block_parts {
  const attention_core& core;
  const rotary_embedding* rotary = nullptr;
  expert_tally& experts;
  torch::Tensor positions = {};
};

/// Block i on x. With a cache, x holds the tokens after the cache's (entry `cache_index`).
torch::Tensor decoder_block(const part_context& c, torch::Tensor x, int i, kv_cache* cache, int cache_index,
                            const block_parts& parts);

}  // namespace troupe
