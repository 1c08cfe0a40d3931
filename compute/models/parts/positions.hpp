#pragma once
// Position encodings: a learned table added to the token embedding (GPT-2's), or the
// rotary embedding of queries and keys (Llama's, with Hugging Face's rotate_half).
#include <cstdint>
#include <string>

#include <torch/types.h>

#include "compute/models/model_spec.hpp"
#include "compute/models/parameter.hpp"

namespace troupe {

/// The learned table `name` of `positions` rows of `width` (every tensor-parallel rank
/// holds it whole; no weight decay).
param_table learned_position_params(const std::string& name, std::int64_t positions, std::int64_t width);

/// x (B, T, d) plus the rows from, from + 1, ... of the learned `table`, on `device`; with
/// `positions` ((B, T) int64, documents), the rows they name instead.
torch::Tensor add_learned_positions(const torch::Tensor& x, const torch::Tensor& table, std::int64_t from,
                                    torch::Device device, const torch::Tensor& positions = {});

/// The documents of the window a slice computes (--document-attention): its tokens'
/// positions and the mask they give. Both undefined: one causal sequence.
struct window_documents {
  torch::Tensor positions;  ///< (B, T) int64
  torch::Tensor mask;       ///< (B, 1, T, T) bool
  /// Context parallelism: each token's document number in its whole sequence ((B, S)
  /// int64, cp::document_numbers), by which the group's core masks (no mask above; the
  /// positions are this rank's tokens').
  torch::Tensor numbers;
};

/// Rotary tables as Hugging Face computes them, in fp32: inv_freq[j] = 1 / theta^(2j / hd),
/// angle = position * inv_freq[j]; cos and sin of [angles, angles] (length hd).
class rotary_embedding {
 public:
  rotary_embedding(const decoder_config& cfg, torch::Device device);
  /// The rotary embedding of q or k (B, heads, T, hd) at positions from, from + 1, ...
  /// (the tables cast to x's dtype, as Hugging Face does); with `positions` ((B, T) int64,
  /// documents), at the positions they give each sequence's tokens instead.
  torch::Tensor rotate(const torch::Tensor& x, std::int64_t from, const torch::Tensor& positions = {}) const;

 private:
  torch::Tensor cos_, sin_;  ///< (seq_len, head dim), fp32
};

}  // namespace troupe
