#include "compute/models/family.hpp"

namespace troupe {

namespace {

/// WORKLOADS.md "gpt-tiny": GPT-2's blocks (learned positions, LayerNorm with biases,
/// fused qkv, GELU MLP), Hugging Face's GPT2LMHeadModel names without "transformer.".
decoder_family gpt2() {
  decoder_family f{decoder_arch::gpt2, norm_kind::layer_norm, position_kind::learned, {}, {}, {}, "h.", "wte.weight",
                   "wpe.weight", "ln_1", "ln_2", "ln_f", "lm_head.weight"};
  f.attention.fused_qkv = true;
  f.attention.qkv_bias = f.attention.out_bias = true;
  f.attention.prefix = "attn.";
  f.attention.qkv = "c_attn";
  f.attention.out = "c_proj";
  f.mlp = {mlp_kind::gelu, true, "mlp.", "c_fc", "", "c_proj"};
  return f;
}

/// WORKLOADS.md "llama-tiny" and "moe-tiny": rotary positions, RMSNorm, grouped-query
/// attention, SwiGLU MLP (or Mixtral's experts), no biases; LlamaForCausalLM's names.
decoder_family llama() {
  decoder_family f{decoder_arch::llama, norm_kind::rms_norm, position_kind::rotary, {}, {}, {}, "model.layers.",
                   "model.embed_tokens.weight", "", "input_layernorm", "post_attention_layernorm", "model.norm",
                   "lm_head.weight"};
  f.attention.prefix = "self_attn.";
  f.attention.q = "q_proj";
  f.attention.k = "k_proj";
  f.attention.v = "v_proj";
  f.attention.out = "o_proj";
  f.mlp = {mlp_kind::swiglu, false, "mlp.", "up_proj", "gate_proj", "down_proj"};
  f.experts = {"block_sparse_moe.", "gate", "experts.", "w1", "w2", "w3"};
  return f;
}

/// Mistral (and Mixtral): Llama's blocks, with a sliding window of attention.
decoder_family mistral() {
  auto f = llama();
  f.arch = decoder_arch::mistral;
  f.attention.sliding_window = true;
  return f;
}

/// Qwen2: Llama's blocks with biases on the q, k and v projections (not on o_proj).
decoder_family qwen2() {
  auto f = llama();
  f.arch = decoder_arch::qwen2;
  f.attention.qkv_bias = true;
  return f;
}

/// Qwen3 (and Qwen3-MoE): Llama's blocks with an RMSNorm of each head's query and key;
/// the experts are the MLP's ("mlp.gate", "mlp.experts.0.gate_proj", ...).
decoder_family qwen3() {
  auto f = llama();
  f.arch = decoder_arch::qwen3;
  f.attention.q_norm = "q_norm";
  f.attention.k_norm = "k_norm";
  f.experts = {"mlp.", "gate", "experts.", "gate_proj", "down_proj", "up_proj"};
  return f;
}

}  // namespace

const decoder_family& family_of(decoder_arch arch) {
  static const decoder_family gpt2_family = gpt2(), llama_family = llama(), mistral_family = mistral(),
                              qwen2_family = qwen2(), qwen3_family = qwen3();
  switch (arch) {
    case decoder_arch::gpt2: return gpt2_family;
    case decoder_arch::llama: return llama_family;
    case decoder_arch::mistral: return mistral_family;
    case decoder_arch::qwen2: return qwen2_family;
    case decoder_arch::qwen3: return qwen3_family;
  }
  return gpt2_family;
}

}  // namespace troupe
