#pragma once
// A decoder family is a table of choices, not a class: which norm, which positions, the
// attention's options, which MLP, and the parameters' names. The decoder slice composes
// the parts of compute/models/parts/ as the table says; a new family with the same parts
// is a new row, and one that needs a new kind of part (a q/k norm, say) is one new option
// of that part.
#include <string>

#include "compute/models/model_spec.hpp"

namespace troupe {

/// The norms of a family (every norm of its blocks and the final one).
enum class norm_kind {
  layer_norm,  ///< LayerNorm with weight and bias
  rms_norm,    ///< RMSNorm with a weight, Hugging Face's (statistics in fp32)
};

/// Where the positions enter.
enum class position_kind {
  learned,  ///< a learned table added to the token embedding (GPT-2's wpe)
  rotary,   ///< rotary embedding of the queries and keys (Llama's)
};

/// The dense MLP of a block.
enum class mlp_kind {
  gelu,    ///< up, GELU (exact, or its tanh form: decoder_config::gelu_tanh), down (GPT-2's c_fc, c_proj)
  swiglu,  ///< down(silu(gate(x)) * up(x)) (Llama's gate_proj, up_proj, down_proj)
};

/// The attention's options and names (relative to a block's prefix).
struct attention_options {
  bool fused_qkv = false;  ///< one projection [q; k; v] (GPT-2's c_attn) instead of three
  bool qkv_bias = false;   ///< biases on the q, k and v projections (GPT-2's, Qwen2's)
  bool out_bias = false;   ///< a bias on the output projection (GPT-2's)
  bool sliding_window = false;  ///< decoder_config::sliding_window applies (Mistral's)
  std::string prefix;      ///< "attn." / "self_attn."
  std::string qkv;         ///< fused: "c_attn"
  std::string q, k, v;     ///< separate: "q_proj", "k_proj", "v_proj"
  std::string out;         ///< "c_proj" / "o_proj"
  /// Qwen3's RMSNorm of each head's query and key (one weight of head_dim, shared by the
  /// heads), before the rotary embedding: "q_norm", "k_norm"; empty: none.
  std::string q_norm, k_norm;
};

/// The dense MLP's options and names (relative to a block's prefix).
struct mlp_options {
  mlp_kind kind = mlp_kind::gelu;
  bool bias = false;   ///< biases on its projections
  std::string prefix;  ///< "mlp."
  std::string up;      ///< gelu: the first projection ("c_fc"); swiglu: "up_proj"
  std::string gate;    ///< swiglu: "gate_proj"
  std::string down;    ///< "c_proj" / "down_proj"
};

/// The sparse MLP (mixture of experts; names relative to a block's prefix).
struct expert_options {
  std::string prefix;  ///< Mixtral's "block_sparse_moe.", Qwen3-MoE's "mlp."
  std::string router;  ///< "gate"
  std::string experts; ///< "experts." (then the expert's index and ".")
  std::string gate, down, up;  ///< each expert's SwiGLU: Mixtral's "w1", "w2", "w3"; Qwen3-MoE's
                               ///< "gate_proj", "down_proj", "up_proj"
};

struct decoder_family {
  decoder_arch arch;
  norm_kind norm;
  position_kind positions;
  attention_options attention;
  mlp_options mlp;
  expert_options experts;
  // The parameters' names (Hugging Face's).
  std::string block_prefix;        ///< "h." / "model.layers." (then the block's index and ".")
  std::string token_embedding;     ///< "wte.weight" / "model.embed_tokens.weight"
  std::string position_embedding;  ///< learned positions: "wpe.weight"
  std::string attention_norm;      ///< in a block: "ln_1" / "input_layernorm"
  std::string mlp_norm;            ///< in a block: "ln_2" / "post_attention_layernorm"
  std::string final_norm;          ///< "ln_f" / "model.norm"
  std::string output;              ///< an untied output layer: "lm_head.weight"

  std::string block(int i) const { return block_prefix + std::to_string(i) + "."; }
};

/// The table of `arch`.
const decoder_family& family_of(decoder_arch arch);

}  // namespace troupe
