#pragma once
// Attention: projections (fused [q; k; v] or separate, with or without biases), grouped
// key/value heads, rotary positions when the family has them, the causal core, the
// key/value cache of generation, and the output projection. Under tensor parallelism the
// projections are column-parallel (whole heads per rank) and the output row-parallel.
#include <cstdint>
#include <functional>
#include <string>

#include <torch/types.h>

#include "compute/models/family.hpp"
#include "compute/models/kv_cache.hpp"
#include "compute/models/parameter.hpp"
#include "compute/models/parts/context.hpp"
#include "compute/models/parts/positions.hpp"

namespace troupe {

/// The attention's parameters in block `block` ("h.0."), in the family's order.
param_table attention_params(const decoder_family& f, const decoder_config& c, const std::string& block);

/// The causal core, softmax(q k^T / sqrt(hd)) v, for queries at positions past, past + 1,
/// ... and keys from position 0 (q: (B, H, T, hd); k, v: (B, KV, past + T, hd); query head
/// h uses key/value head h / (H / KV)). With a `window` (Mistral's sliding window), the
/// query at position i sees the keys at positions i - window + 1 .. i only. With a
/// `mask` ((B, 1, T, T) bool, document_mask's: documents in the window; no cache), the
/// query sees the keys the mask allows instead.
class causal_attention {
 public:
  causal_attention(std::int64_t seq_len, torch::Device device, std::int64_t window = 0);
  torch::Tensor operator()(const torch::Tensor& q, torch::Tensor k, torch::Tensor v, std::int64_t past,
                           const torch::Tensor& mask = {}) const;
  /// The mask of the documents at `positions` (B, T; document_positions': a position 0
  /// begins one): query i sees key j where the causal mask (and the window) lets it and
  /// no document begins in (j, i]. (B, 1, T, T) bool.
  torch::Tensor document_mask(const torch::Tensor& positions) const;

 private:
  torch::Tensor causal_;  ///< (seq_len, seq_len) bool, lower triangle (within the window)
  bool windowed_ = false;  ///< a window shorter than seq_len
};

/// The core an attention runs (causal_attention, or a wrapper of it: selective recompute).
using attention_core =
    std::function<torch::Tensor(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, std::int64_t past)>;

/// The attention of block `block` on `x` (its normed input, (B, T, d)): what the residual
/// adds. With a cache, `x` holds the tokens after the cache's: their keys and values are
/// appended to the block's (entry `cache_index` of the cache), and they attend to all of
/// them. `rotary`: the family's rotary embedding (nullptr: learned positions), at the
/// tokens' `positions` when given ((B, T) int64, documents; no cache).
torch::Tensor attention(const part_context& c, const torch::Tensor& x, const std::string& block, kv_cache* cache,
                        int cache_index, const attention_core& core, const rotary_embedding* rotary,
                        const torch::Tensor& positions = {});

}  // namespace troupe
