#pragma once
// Which model and its shape: the decoders (gpt2, llama and their mixtures of experts) and
// the Fashion-MNIST MLP, with the shapes of WORKLOADS.md's workloads.
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace troupe {

struct model_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// A decoder's architecture (a row of compute/models/family.cpp): GPT-2's (WORKLOADS.md
/// "gpt-tiny": learned positions, LayerNorm with biases, fused qkv, GELU MLP) or Llama's
/// ("llama-tiny": rotary positions, RMSNorm, grouped-query attention, SwiGLU MLP, no
/// biases; Hugging Face names), and Llama's relatives: Mistral (a sliding window), Qwen2
/// (biases on q, k and v), Qwen3 (RMSNorm of each head's q and k). With experts, llama and
/// mistral are Mixtral, qwen3 is Qwen3-MoE.
enum class decoder_arch { gpt2, llama, mistral, qwen2, qwen3 };

/// The rotary embedding's frequencies (Hugging Face's rope_type): unscaled, every one
/// divided by `factor` (linear), or Llama 3.1's: the low ones divided, the high ones kept,
/// those between interpolated.
struct rope_scaling {
  enum class kind { none, linear, llama3 } type = kind::none;
  double factor = 1;
  double low_freq_factor = 1, high_freq_factor = 4;  ///< llama3
  int original_positions = 8192;                     ///< llama3: original_max_position_embeddings
  bool operator==(const rope_scaling& o) const {
    return type == o.type && factor == o.factor && low_freq_factor == o.low_freq_factor &&
           high_freq_factor == o.high_freq_factor && original_positions == o.original_positions;
  }
};

/// A decoder's shape (Megatron's TransformerConfig, for the two architectures).
struct decoder_config {
  int n_layer = 8;
  int n_head = 4;
  int d_model = 128;
  int d_ff = 512;
  int seq_len = 128;
  int vocab = 256;              ///< rows of the token embedding (and of the output layer)
  decoder_arch arch = decoder_arch::gpt2;
  int n_kv_head = 0;            ///< llama: key/value heads (grouped-query attention); 0: n_head
  double rope_theta = 10000;    ///< llama: the rotary embedding's base
  double norm_eps = 1e-5;       ///< LayerNorm's / RMSNorm's epsilon
  bool tie_embeddings = true;   ///< the output layer is the token embedding (no lm_head)
  int vocab_used = 0;           ///< a tokenizer's pieces, below vocab: the padded rows' logits are
                                ///< left out of the softmax (as minus infinity); 0: every row is used
  // Mixture of experts (WORKLOADS.md "moe-tiny"; llama): Mixtral's sparse MLP in place of
  // the MLP of every moe_every-th block (blocks 0, moe_every, 2 moe_every, ...).
  int n_experts = 0;            ///< 0: dense
  int moe_top_k = 2;            ///< experts per token
  int moe_d_ff = 0;             ///< each expert's width (0: d_ff)
  double moe_aux_coeff = 0.01;  ///< the load-balancing loss's coefficient
  int moe_every = 1;
  /// Training drops the (token, choice) pairs past each expert's capacity in a sequence,
  /// expert_capacity(seq_len) (Megatron's moe_expert_capacity_factor, per sequence); 0: none.
  double moe_capacity_factor = 0;
  int head_size = 0;            ///< a head's width (0: d_model / n_head; Qwen3's head_dim)
  bool gelu_tanh = false;       ///< gpt2: GELU's tanh approximation (Hugging Face's gelu_new)
  rope_scaling rope{};          ///< rotary positions' scaling
  int sliding_window = 0;       ///< mistral: a query sees itself and the sliding_window - 1 keys
                                ///< before it (0: every earlier key)
  bool moe_norm_topk = true;    ///< the top-k router probabilities renormalised to sum 1 (Mixtral;
                                ///< Qwen3-MoE's norm_topk_prob)
  int moe_first = 0;            ///< experts in blocks moe_first, moe_first + moe_every, ...
  std::vector<int> moe_dense{}; ///< blocks kept dense anyway (Qwen3-MoE's mlp_only_layers)

  int head_dim() const { return head_size > 0 ? head_size : d_model / n_head; }
  int kv_heads() const { return n_kv_head > 0 ? n_kv_head : n_head; }
  bool is_moe_block(int i) const {
    if (n_experts == 0 || i < moe_first || (i - moe_first) % moe_every != 0) return false;
    for (int d : moe_dense)
      if (d == i) return false;
    return true;
  }
  int expert_d_ff() const { return moe_d_ff > 0 ? moe_d_ff : d_ff; }
  /// The (token, choice) pairs an expert takes of a sequence of `tokens` in training:
  /// ceil(factor x tokens x top_k / experts) (Megatron's get_capacity); 0: no limit.
  std::int64_t expert_capacity(std::int64_t tokens) const {
    if (moe_capacity_factor <= 0 || n_experts == 0) return 0;
    return std::int64_t(std::ceil(moe_capacity_factor * double(tokens * moe_top_k) / double(n_experts)));
  }
};

/// Which model and its shape.
struct model_spec {
  enum class kind { decoder, mlp };
  kind type = kind::decoder;
  decoder_config decoder;
  std::vector<int> mlp_widths{784, 512, 512, 256, 10};  ///< fmnist-mlp

  static model_spec gpt_tiny() { return {}; }
  /// GPT-2 124M's shape (12 layers, 12 heads, d_model 768, seq 1024) on 256 byte values.
  static model_spec gpt_small() {
    model_spec s;
    s.decoder = {12, 12, 768, 3072, 1024, 256};
    return s;
  }
  /// WORKLOADS.md "llama-tiny": 8 layers, 4 heads, 2 key/value heads, d_model 128, d_ff 384.
  static model_spec llama_tiny() {
    model_spec s;
    s.decoder = {8, 4, 128, 384, 128, 256, decoder_arch::llama, 2, 10000, 1e-5, false};
    return s;
  }
  /// For GPUs: 12 layers, d_model 768, 12 heads, 4 key/value heads, d_ff 2048, seq 1024.
  static model_spec llama_small() {
    model_spec s;
    s.decoder = {12, 12, 768, 2048, 1024, 256, decoder_arch::llama, 4, 10000, 1e-5, false};
    return s;
  }
  /// WORKLOADS.md "moe-tiny": llama-tiny whose every MLP is 4 SwiGLU experts of d_ff 192, top-2.
  static model_spec moe_tiny() {
    model_spec s = llama_tiny();
    s.decoder.n_experts = 4;
    s.decoder.moe_d_ff = 192;
    return s;
  }
  /// For GPUs: llama-small with 8 experts (each of llama-small's d_ff), top-2.
  static model_spec moe_small() {
    model_spec s = llama_small();
    s.decoder.n_experts = 8;
    return s;
  }
  static model_spec fmnist_mlp() {
    model_spec s;
    s.type = kind::mlp;
    return s;
  }
  /// A decoder of Llama's kind (rotary positions, RMSNorm, Hugging Face's model.layers names).
  bool is_llama() const { return type == kind::decoder && decoder.arch != decoder_arch::gpt2; }
  /// Number of sliceable layers (transformer blocks or Linear layers).
  int n_layers() const { return type == kind::decoder ? decoder.n_layer : int(mlp_widths.size()) - 1; }
  std::string name() const;
};

/// "gpt2", "llama", "mistral", "qwen2" or "qwen3"; throws std::invalid_argument otherwise.
decoder_arch parse_decoder_arch(const std::string& name);
const char* decoder_arch_name(decoder_arch arch);

/// Activation recomputation (see model_slice::set_recompute).
enum class recompute_mode { none, selective, full };
/// "none", "selective" or "full"; throws std::invalid_argument otherwise.
recompute_mode parse_recompute(const std::string& name);

}  // namespace troupe
