#pragma once
// The decoder slice a pipeline stage holds: the token embedding (and learned positions)
// on the first slice, its range of blocks, the final norm and the output layer on the
// last, composed of compute/models/parts/ as the family's table says.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include <torch/types.h>

#include "compute/models/family.hpp"
#include "compute/models/model_slice.hpp"
#include "compute/models/parts/attention.hpp"
#include "compute/models/parts/positions.hpp"
#include "compute/models/recompute.hpp"

namespace troupe {

class decoder_slice final : public model_slice, block_runner {
 public:
  /// See make_slice (compute/models/model.hpp).
  decoder_slice(const model_spec& spec, const layer_range& range, const state_dict& state, std::int64_t pad_to,
                torch::Device device, torch::ScalarType param_dtype, const tensor_parallel& tp,
                const expert_share& experts);

  torch::Tensor forward(const torch::Tensor& input, const torch::Tensor& positions = {}) override;
  torch::Tensor forward_cached(const torch::Tensor& input, kv_cache& cache) override;
  torch::Tensor logits(const torch::Tensor& output) override;
  torch::Tensor loss(const torch::Tensor& output, const torch::Tensor& target) override;

  torch::Tensor run_block(const torch::Tensor& x, int i, block_pass pass, const window_documents& documents) override;
  weight_grad_store*& deferral() override { return defer_; }
  void set_context_parallel(context_parallel cp) override;

 private:
  /// Block i (with a cache: of generation), run as `pass` says, attending by `documents`.
  torch::Tensor block(const torch::Tensor& x, int i, kv_cache* cache, block_pass pass,
                      const window_documents& documents = {});
  /// The logits of this rank's vocabulary columns (all of them without tensor
  /// parallelism); the padded rows' are minus infinity.
  torch::Tensor own_logits(const torch::Tensor& output);
  /// Token (and learned position) embeddings of `tokens` (batch, T) at positions from,
  /// from + 1, ... Tensor parallelism: vocab-parallel, summed over the group (with
  /// `sequence`, reduce-scattered: this rank's positions only).
  torch::Tensor embed(const torch::Tensor& tokens, std::int64_t from, bool sequence,
                      const torch::Tensor& positions = {});
  /// The residual stream in its dtype (see model_slice::set_residual_dtype): `x` rounded
  /// to bf16 under bf16 autocast when the slice keeps a bf16 stream, else `x`.
  torch::Tensor to_residual(const torch::Tensor& x) const;
  torch::Tensor final_norm(const torch::Tensor& x);
  bool sequence() const { return tp_.active() && tp_.sequence; }
  collective_group& group() const;
  /// The context of the parts in a pass (sequence parallelism in it: `sequence`).
  part_context context(bool sequence, block_pass pass);

  decoder_config cfg_;
  const decoder_family& family_;
  tensor_parallel tp_;
  std::int64_t heads_ = cfg_.n_head, kv_heads_ = cfg_.kv_heads();  ///< this rank's
  std::int64_t vocab_first_ = 0;  ///< this rank's first vocabulary row (tensor parallelism)
  std::unique_ptr<causal_attention> core_;
  std::int64_t window_ = 0;  ///< the family's sliding window (0: none)
  std::optional<rotary_embedding> rotary_;  ///< a family with rotary positions
  std::string embedding_, output_;         ///< the token embedding's and the output layer's names
  torch::Tensor padded_;                   ///< (vocab) bool: the rows past the tokenizer's pieces
};

}  // namespace troupe
