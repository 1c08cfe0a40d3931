#include "compute/checkpoint/hf_folder.hpp"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "compute/checkpoint/checkpoint.hpp"
#include "compute/checkpoint/safetensors.hpp"
#include "compute/models/family.hpp"

namespace troupe {

namespace fs = std::filesystem;

namespace {

bool ends_with(const std::string& s, const std::string& end) {
  return s.size() >= end.size() && s.compare(s.size() - end.size(), end.size(), end) == 0;
}

/// gpt2 weights that GPT2LMHeadModel keeps as Conv1D ([in, out]).
bool conv1d_weight(const std::string& name) {
  for (const char* end : {"attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"})
    if (ends_with(name, end)) return true;
  return false;
}

/// The embedding-sized tensors (vocab rows): padded rows are not exported.
bool vocab_rows(const model_spec& spec, const std::string& name) {
  return name == "lm_head.weight" || name == (spec.is_llama() ? "model.embed_tokens.weight" : "wte.weight");
}

const char* dtype_name(torch::ScalarType t) {
  switch (t) {
    case torch::kFloat32: return "float32";
    case torch::kBFloat16: return "bfloat16";
    case torch::kFloat16: return "float16";
    default: throw std::invalid_argument(std::string("export dtype ") + c10::toString(t) + ": expected float32, bfloat16 or float16");
  }
}

nlohmann::json read_json(const fs::path& path) {
  std::ifstream in(path);
  if (!in) throw checkpoint_error("cannot read " + path.string());
  try {
    return nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw checkpoint_error(path.string() + " is not valid JSON (" + e.what() + ")");
  }
}

/// A real number as config.json's readers expect it in messages (1e-06, 500000).
std::string fmt_number(double x) {
  std::ostringstream o;
  o << x;
  return o.str();
}

/// The rotary scaling, for messages.
std::string rope_text(const rope_scaling& r) {
  switch (r.type) {
    case rope_scaling::kind::none: return "none";
    case rope_scaling::kind::linear: return "linear, factor " + fmt_number(r.factor);
    case rope_scaling::kind::llama3:
      return "llama3, factor " + fmt_number(r.factor) + ", low_freq_factor " + fmt_number(r.low_freq_factor) +
             ", high_freq_factor " + fmt_number(r.high_freq_factor) + ", original_max_position_embeddings " +
             std::to_string(r.original_positions);
  }
  return "none";
}

/// The families config.json's model_type names, Troupe's architecture for each, and
/// whether its MLPs are experts.
struct hf_family {
  const char* type;
  decoder_arch arch;
  bool experts;
};
constexpr hf_family kFamilies[] = {{"llama", decoder_arch::llama, false},      {"mistral", decoder_arch::mistral, false},
                                   {"mixtral", decoder_arch::mistral, true},   {"qwen2", decoder_arch::qwen2, false},
                                   {"qwen3", decoder_arch::qwen3, false},      {"qwen3_moe", decoder_arch::qwen3, true},
                                   {"gpt2", decoder_arch::gpt2, false}};

const hf_family* family_named(const std::string& type) {
  for (const auto& f : kFamilies)
    if (type == f.type) return &f;
  return nullptr;
}

/// Families whose folders hold the same computation (Llama's blocks and Mistral's, whose
/// window is compared on its own).
bool same_blocks(decoder_arch a, decoder_arch b) {
  auto llama_like = [](decoder_arch x) { return x == decoder_arch::llama || x == decoder_arch::mistral; };
  return a == b || (llama_like(a) && llama_like(b));
}

/// config.json's fields, read one by one; what cannot be read goes into `problems`.
struct config_reader {
  const nlohmann::json& c;
  std::vector<std::string>& problems;

  const nlohmann::json* find(const std::string& key) const {
    const auto it = c.find(key);
    return it == c.end() || it->is_null() ? nullptr : &*it;
  }
  /// A positive integer; `fallback` when missing or null (0: required).
  int integer(const std::string& key, int fallback) const {
    const auto* v = find(key);
    if (!v) {
      if (fallback <= 0) problems.push_back("no " + key);
      return fallback;
    }
    if (!v->is_number_integer() || v->get<long long>() < 1 || v->get<long long>() > (1LL << 30)) {
      problems.push_back(key + " " + v->dump() + " (expected a positive integer)");
      return fallback;
    }
    return int(v->get<long long>());
  }
  /// A number above `above` (or at least 0 with `zero_ok`).
  double real(const std::string& key, double fallback, bool zero_ok = false) const {
    const auto* v = find(key);
    if (!v) return fallback;
    if (!v->is_number() || v->get<double>() < 0 || (!zero_ok && v->get<double>() == 0)) {
      problems.push_back(key + " " + v->dump() + (zero_ok ? " (expected a number, 0 or more)" : " (expected a positive number)"));
      return fallback;
    }
    return v->get<double>();
  }
  bool boolean(const std::string& key, bool fallback) const {
    const auto* v = find(key);
    if (!v) return fallback;
    if (!v->is_boolean()) {
      problems.push_back(key + " " + v->dump() + " (expected true or false)");
      return fallback;
    }
    return v->get<bool>();
  }
  std::string text(const std::string& key, const std::string& fallback) const {
    const auto* v = find(key);
    if (!v) return fallback;
    if (!v->is_string()) {
      problems.push_back(key + " " + v->dump() + " (expected a string)");
      return fallback;
    }
    return v->get<std::string>();
  }
};

/// The rotary embedding in both spellings: transformers 4.x writes `rope_theta` and
/// `rope_scaling` at the top level, 5.x one `rope_parameters` object ({"rope_theta": ...,
/// "rope_type": ...}). rope_type default, linear and llama3 are Troupe's; any other, or a
/// partial rotation, goes into `problems`, never read as the default.
void read_rope(const config_reader& r, double default_theta, decoder_config& g) {
  g.rope_theta = r.real("rope_theta", default_theta);
  const auto* params = r.find("rope_parameters");
  const std::string key = params ? "rope_parameters" : "rope_scaling";
  const auto* scaling = params ? params : r.find("rope_scaling");
  if (scaling && !scaling->is_object()) {
    r.problems.push_back(key + " " + scaling->dump() + " (expected an object)");
    scaling = nullptr;
  }
  if (scaling) {
    const config_reader s{*scaling, r.problems};
    if (params) g.rope_theta = s.real("rope_theta", g.rope_theta);
    // 4.x's rope_scaling names it "rope_type" (older files "type").
    const std::string type = s.text("rope_type", s.text("type", "default"));
    auto number = [&](const char* name, double fallback) {
      const auto* v = s.find(name);
      if (!v && fallback <= 0) r.problems.push_back(key + " rope_type " + type + " without " + name);
      if (v && (!v->is_number() || v->get<double>() <= 0)) {
        r.problems.push_back(key + "." + name + " " + v->dump() + " (expected a positive number)");
        return fallback;
      }
      return v ? v->get<double>() : fallback;
    };
    auto& rope = g.rope;
    if (type == "linear") {
      rope.type = rope_scaling::kind::linear;
      rope.factor = number("factor", 0);
    } else if (type == "llama3") {
      rope.type = rope_scaling::kind::llama3;
      rope.factor = number("factor", 0);
      rope.low_freq_factor = number("low_freq_factor", 0);
      rope.high_freq_factor = number("high_freq_factor", 0);
      rope.original_positions = int(number("original_max_position_embeddings", 0));
      if (rope.high_freq_factor <= rope.low_freq_factor)
        r.problems.push_back(key + " high_freq_factor " + fmt_number(rope.high_freq_factor) +
                             " is not above low_freq_factor " + fmt_number(rope.low_freq_factor));
    } else if (type != "default") {
      r.problems.push_back(key + " rope_type " + type +
                           " (Troupe's rotary embedding is the default one, linear or llama3)");
    }
    if (const auto* partial = s.find("partial_rotary_factor"); partial && !(partial->is_number() && partial->get<double>() == 1))
      r.problems.push_back(key + " partial_rotary_factor " + partial->dump() + " (Troupe rotates every dimension)");
  }
  if (const auto* partial = r.find("partial_rotary_factor"); partial && !(partial->is_number() && partial->get<double>() == 1))
    r.problems.push_back("partial_rotary_factor " + partial->dump() + " (Troupe rotates every dimension)");
}

/// A window shorter than the sequence (what masks anything), else 0.
int effective_window(int window, int seq_len) { return window > 0 && window < seq_len ? window : 0; }

/// What config.json describes, with every field it cannot take in `problems`. `seq_len`:
/// the job's (0: unknown), against which a family without a sliding window refuses one.
hf_model_shape parse_config(const nlohmann::json& c, int seq_len, std::vector<std::string>& problems) {
  const config_reader r{c, problems};
  hf_model_shape out;
  out.model_type = r.text("model_type", "");
  const auto* family = family_named(out.model_type);
  if (!family) {
    problems.push_back(std::string("model_type ") + (out.model_type.empty() ? "(none)" : "'" + out.model_type + "'") +
                       " is not a family Troupe reads (" + hf_families() + ")");
    return out;
  }
  auto& g = out.decoder;
  g.arch = family->arch;
  const std::string& type = out.model_type;
  if (g.arch == decoder_arch::gpt2) {
    g.d_model = r.integer("n_embd", 0);
    g.n_layer = r.integer("n_layer", 0);
    g.n_head = r.integer("n_head", 0);
    g.d_ff = r.integer("n_inner", 4 * std::max(g.d_model, 1));
    g.vocab = r.integer("vocab_size", 0);
    g.seq_len = out.max_positions = r.integer("n_positions", 0);
    g.norm_eps = r.real("layer_norm_epsilon", 1e-5);
    g.tie_embeddings = r.boolean("tie_word_embeddings", true);
    if (g.n_head > 0 && g.d_model % g.n_head != 0)
      problems.push_back("n_embd " + std::to_string(g.d_model) + " is not a multiple of n_head " + std::to_string(g.n_head));
    const std::string act = r.text("activation_function", "gelu_new");  // GPT2Config's default
    if (act == "gelu_new" || act == "gelu_pytorch_tanh")
      g.gelu_tanh = true;
    else if (act != "gelu")
      problems.push_back("activation_function " + act + " (Troupe's gpt2 takes gelu, gelu_new and gelu_pytorch_tanh)");
    if (!r.boolean("scale_attn_weights", true))
      problems.push_back("scale_attn_weights false (Troupe's attention scales by 1 / sqrt(head dim))");
    if (r.boolean("scale_attn_by_inverse_layer_idx", false))
      problems.push_back("scale_attn_by_inverse_layer_idx true (Troupe's attention scales by 1 / sqrt(head dim) only)");
    return out;
  }
  const bool qwen3 = g.arch == decoder_arch::qwen3;
  g.d_model = r.integer("hidden_size", 0);
  g.n_layer = r.integer("num_hidden_layers", 0);
  g.n_head = r.integer("num_attention_heads", 0);
  g.n_kv_head = r.integer("num_key_value_heads", type == "llama" ? g.n_head : 0);
  g.d_ff = r.integer("intermediate_size", 0);
  g.vocab = r.integer("vocab_size", 0);
  g.norm_eps = r.real("rms_norm_eps", type == "mixtral" ? 1e-5 : 1e-6);  // the families' defaults
  g.tie_embeddings = r.boolean("tie_word_embeddings", false);
  read_rope(r, type == "mixtral" ? 1e6 : 10000, g);
  out.max_positions = r.find("max_position_embeddings") ? r.integer("max_position_embeddings", 0) : 0;
  // A head's width: Qwen3's own (128 by default), the others' hidden / heads unless given.
  const int heads_width = g.n_head > 0 ? g.d_model / g.n_head : 0;
  const int head_dim = r.integer("head_dim", qwen3 ? 128 : std::max(heads_width, 1));
  if (head_dim != heads_width || (g.n_head > 0 && g.d_model % g.n_head != 0)) g.head_size = head_dim;
  if (g.n_head > 0 && g.n_kv_head > 0 && g.n_head % g.n_kv_head != 0)
    problems.push_back("num_attention_heads " + std::to_string(g.n_head) + " is not a multiple of num_key_value_heads " +
                       std::to_string(g.n_kv_head));
  if (const auto act = r.text("hidden_act", "silu"); act != "silu")
    problems.push_back("hidden_act " + act + " (the MLP is SwiGLU: silu)");
  // Biases: Qwen2's on q, k and v are its family's; Llama's and Qwen3's switches are not Troupe's.
  if (g.arch != decoder_arch::qwen2)
    for (const char* bias : {"attention_bias", "mlp_bias"})
      if (r.boolean(bias, false)) problems.push_back(std::string(bias) + " true (" + type + " has no biases in Troupe)");
  for (const char* key : {"attn_logit_softcapping", "final_logit_softcapping", "attention_dropout",
                          "router_jitter_noise", "shared_expert_intermediate_size"}) {
    const auto* v = r.find(key);
    if (v && !(v->is_number() && v->get<double>() == 0))
      problems.push_back(std::string(key) + " " + v->dump() + " (Troupe's blocks have none)");
  }
  // The sliding window: Mistral's and Mixtral's is the model's; the others' (Qwen's
  // use_sliding_window, 5.x's layer_types) only when it masks nothing.
  const auto* window = r.find("sliding_window");
  if (window && !window->is_number_integer()) {
    problems.push_back("sliding_window " + window->dump() + " (expected a number of tokens or null)");
    window = nullptr;
  }
  if (g.arch == decoder_arch::mistral) {
    // (MistralConfig's default window is 4096 tokens; Mixtral's none)
    if (type == "mistral" && !c.contains("sliding_window")) g.sliding_window = 4096;
    if (window && r.boolean("use_sliding_window", true)) g.sliding_window = r.integer("sliding_window", 0);
  } else if (window && window->is_number() && r.boolean("use_sliding_window", true) && seq_len > 0 &&
             window->get<double>() < seq_len) {
    problems.push_back("sliding_window " + window->dump() + " (shorter than the job's seq_len " + std::to_string(seq_len) +
                       "; Troupe's " + type + " attention sees the whole sequence)");
  }
  if (const auto* layers = r.find("layer_types"); layers && layers->is_array() && g.arch != decoder_arch::mistral)
    for (const auto& l : *layers)
      if (l.is_string() && l.get<std::string>() != "full_attention" && !(l == "sliding_attention" && (!window ||
                                                                           (seq_len > 0 && window->get<double>() >= seq_len)))) {
        problems.push_back("layer_types " + l.dump() + " (Troupe's " + type + " layers are full_attention)");
        break;
      }
  if (family->experts) {
    const bool mixtral = type == "mixtral";
    // (transformers 5.x writes a Qwen3-MoE's num_experts as num_local_experts, Mixtral's name)
    const char* count = mixtral || (!r.find("num_experts") && r.find("num_local_experts")) ? "num_local_experts" : "num_experts";
    g.n_experts = r.integer(count, mixtral ? 8 : 128);
    g.moe_top_k = r.integer("num_experts_per_tok", mixtral ? 2 : 8);
    // (WORKLOADS.md section 6: the load-balancing term's coefficient is config.json's, 0 if absent)
    g.moe_aux_coeff = r.real("router_aux_loss_coef", 0, /*zero_ok=*/true);
    if (mixtral) {
      g.moe_d_ff = g.d_ff;  // every block's MLP is the experts, of intermediate_size
    } else {  // Qwen3-MoE: experts in blocks step - 1, 2 step - 1, ... but those of mlp_only_layers
      g.moe_d_ff = r.integer("moe_intermediate_size", 768);
      g.moe_norm_topk = r.boolean("norm_topk_prob", false);
      g.moe_every = r.integer("decoder_sparse_step", 1);
      g.moe_first = g.moe_every - 1;
      if (const auto* dense = r.find("mlp_only_layers")) {
        if (!dense->is_array()) problems.push_back("mlp_only_layers " + dense->dump() + " (expected a list of layers)");
        for (const auto& l : dense->is_array() ? *dense : nlohmann::json::array()) {
          if (!l.is_number_integer() || l.get<long long>() < 0 || l.get<long long>() >= g.n_layer) {
            problems.push_back("mlp_only_layers " + dense->dump() + " (expected layers 0 to " +
                               std::to_string(g.n_layer - 1) + ")");
            break;
          }
          g.moe_dense.push_back(int(l.get<long long>()));
        }
      }
    }
    if (g.moe_top_k > g.n_experts)
      problems.push_back("num_experts_per_tok " + std::to_string(g.moe_top_k) + " is above the " +
                         std::to_string(g.n_experts) + " experts");
  }
  return out;
}

/// config.json's model_type for the model (hf_families()).
std::string hf_model_type(const model_spec& spec) {
  const auto& g = spec.decoder;
  switch (g.arch) {
    case decoder_arch::gpt2: return "gpt2";
    case decoder_arch::llama: return g.n_experts > 0 ? "mixtral" : "llama";
    case decoder_arch::mistral: return g.n_experts > 0 ? "mixtral" : "mistral";
    case decoder_arch::qwen2: return "qwen2";
    case decoder_arch::qwen3: return g.n_experts > 0 ? "qwen3_moe" : "qwen3";
  }
  return "gpt2";
}

/// config.json against the job's model: every field that shapes the weights or the
/// computation must agree.
void check_config(const std::string& dir, const nlohmann::json& c, const model_spec& spec) {
  const auto& mine = spec.decoder;
  const std::string type = c.contains("model_type") && c.at("model_type").is_string() ? c.at("model_type").get<std::string>()
                                                                                        : "(none)";
  const std::string want = hf_model_type(spec);
  const auto* family = family_named(type);
  if (!family || !same_blocks(family->arch, mine.arch) || family->experts != (mine.n_experts > 0))
    throw checkpoint_error("Hugging Face folder " + dir + " holds a " + type + " model (config.json model_type); the job's model is " +
                           want + (family ? ": --model " + dir + " trains the folder's own model"
                                          : std::string(" (Troupe reads ") + hf_families() + ")"));
  std::vector<std::string> differ;
  const auto theirs_shape = parse_config(c, mine.seq_len, differ);
  const auto& theirs = theirs_shape.decoder;
  const bool gpt2 = mine.arch == decoder_arch::gpt2;
  auto same = [&](const std::string& key, int t, int m, const std::string& ours) {
    if (t != m) differ.push_back(key + " " + std::to_string(t) + " (the job's " + ours + " " + std::to_string(m) + ")");
  };
  auto close = [&](const std::string& key, double t, double m, const std::string& ours) {
    if (std::abs(t - m) > 1e-9 * std::max(1.0, std::abs(m)))
      differ.push_back(key + " " + fmt_number(t) + " (the job's " + ours + " " + fmt_number(m) + ")");
  };
  if (theirs.vocab < 1 || theirs.vocab > mine.vocab)
    differ.push_back("vocab_size " + std::to_string(theirs.vocab) + " (the job's vocab " + std::to_string(mine.vocab) +
                     ": at most that many rows)");
  if (theirs.tie_embeddings != mine.tie_embeddings)
    differ.push_back(std::string("tie_word_embeddings ") + (theirs.tie_embeddings ? "true" : "false") +
                     " (the job's tie_embeddings " + (mine.tie_embeddings ? "true" : "false") + ")");
  same(gpt2 ? "n_embd" : "hidden_size", theirs.d_model, mine.d_model, "d_model");
  same(gpt2 ? "n_layer" : "num_hidden_layers", theirs.n_layer, mine.n_layer, "layers");
  same(gpt2 ? "n_head" : "num_attention_heads", theirs.n_head, mine.n_head, "heads");
  if (gpt2) {
    same("n_inner", theirs.d_ff, mine.d_ff, "d_ff");
    same("n_positions", theirs.seq_len, mine.seq_len, "seq_len");
    close("layer_norm_epsilon", theirs.norm_eps, mine.norm_eps, "norm_eps");
    if (theirs.gelu_tanh != mine.gelu_tanh)
      differ.push_back(std::string("activation_function ") +
                       (c.contains("activation_function") && c.at("activation_function").is_string()
                            ? c.at("activation_function").get<std::string>()
                            : std::string("gelu_new")) +
                       " (the job's GELU is " +
                       (mine.gelu_tanh ? "the tanh approximation, gelu_new" : "the exact one, gelu") + ")");
  } else {
    const bool mixtral = type == "mixtral";
    if (!mixtral) same("intermediate_size", theirs.d_ff, mine.d_ff, "d_ff");
    same("num_key_value_heads", theirs.kv_heads(), mine.kv_heads(), "kv_heads");
    same("head_dim", theirs.head_dim(), mine.head_dim(), mine.head_size ? "head_dim" : "d_model / heads");
    close("rms_norm_eps", theirs.norm_eps, mine.norm_eps, "norm_eps");
    close("rope_theta", theirs.rope_theta, mine.rope_theta, "rope_theta");
    if (!(theirs.rope == mine.rope))
      differ.push_back("the rotary scaling (rope_scaling / rope_parameters) differs from the job's (" +
                       rope_text(theirs.rope) + " against " + rope_text(mine.rope) + ")");
    const int t_window = effective_window(theirs.sliding_window, mine.seq_len),
              m_window = effective_window(mine.arch == decoder_arch::mistral ? mine.sliding_window : 0, mine.seq_len);
    if (t_window != m_window)
      differ.push_back(t_window ? "sliding_window " + std::to_string(t_window) + " (shorter than the job's seq_len " +
                                      std::to_string(mine.seq_len) + "; the job's attention " +
                                      (m_window ? "window is " + std::to_string(m_window) : std::string("sees the whole sequence")) + ")"
                                : "sliding_window " + (theirs.sliding_window ? std::to_string(theirs.sliding_window) : "null") +
                                      " (the job's sliding_window " + std::to_string(m_window) + ")");
    if (mine.n_experts > 0) {
      same(mixtral ? "intermediate_size" : "moe_intermediate_size", theirs.expert_d_ff(), mine.expert_d_ff(), "moe_d_ff");
      same(mixtral || !c.contains("num_experts") ? "num_local_experts" : "num_experts", theirs.n_experts, mine.n_experts,
           "experts");
      same("num_experts_per_tok", theirs.moe_top_k, mine.moe_top_k, "moe_top_k");
      if (theirs.moe_norm_topk != mine.moe_norm_topk)
        differ.push_back(std::string("norm_topk_prob ") + (theirs.moe_norm_topk ? "true" : "false") +
                         " (the job's top-k weights are " + (mine.moe_norm_topk ? "" : "not ") + "renormalised)");
      for (int i = 0; i < mine.n_layer && i < theirs.n_layer; ++i)
        if (theirs.is_moe_block(i) != mine.is_moe_block(i)) {
          differ.push_back("block " + std::to_string(i) + (theirs.is_moe_block(i) ? " has experts" : " is dense") +
                           " (decoder_sparse_step / mlp_only_layers; the job's block " + std::to_string(i) +
                           (mine.is_moe_block(i) ? " has experts)" : " is dense)"));
          break;
        }
    }
  }
  if (!differ.empty()) {
    std::string msg = "Hugging Face folder " + dir + ": config.json disagrees with the job's model: ";
    for (std::size_t i = 0; i < differ.size(); ++i) msg += (i ? "; " : "") + differ[i];
    throw checkpoint_error(msg);
  }
}

/// Copies file `from` to `to` (written atomically).
void copy_file_atomically(const std::string& from, const std::string& to) {
  const auto bytes = read_file_bytes(from);
  write_file_atomically(to, [&](const byte_sink& sink) { sink(bytes.data(), bytes.size()); });
}

/// transformers 5.x's fused experts (save_pretrained(save_original_format=False)) as the
/// family's per-expert tensors: "model.layers.L.mlp.experts.gate_up_proj" (E, 2 I, H), gate
/// rows first, and "...experts.down_proj" (E, H, I); the router "mlp.gate.weight" under
/// the family's name (Mixtral's block_sparse_moe.gate). Other tensors are kept as they are.
void unfuse_experts(const std::string& dir, const model_spec& spec, std::map<std::string, torch::Tensor>& tensors) {
  const auto& o = family_of(spec.decoder.arch).experts;
  const std::string fused = ".mlp.experts.";
  std::map<std::string, torch::Tensor> out;
  std::set<std::string> fused_layers;  // "model.layers.L."
  for (const auto& [name, t] : tensors) {
    const auto at = name.find(fused);
    const bool gate_up = at != std::string::npos && ends_with(name, fused + "gate_up_proj");
    const bool down = at != std::string::npos && ends_with(name, fused + "down_proj");
    if (!gate_up && !down) {
      out.emplace(name, t);
      continue;
    }
    const std::string layer = name.substr(0, at + 1);
    fused_layers.insert(layer);
    if (t.dim() != 3 || (gate_up && t.size(1) % 2 != 0))
      throw checkpoint_error("Hugging Face folder " + dir + ": tensor " + name + " has shape " + c10::str(t.sizes()) +
                             (gate_up ? ", expected (experts, 2 x intermediate, hidden)" : ", expected (experts, hidden, intermediate)"));
    for (std::int64_t e = 0; e < t.size(0); ++e) {
      const std::string expert = layer + o.prefix + o.experts + std::to_string(e) + ".";
      if (down) {
        out.emplace(expert + o.down + ".weight", t[e]);
      } else {
        const auto halves = t[e].chunk(2, 0);
        out.emplace(expert + o.gate + ".weight", halves[0]);
        out.emplace(expert + o.up + ".weight", halves[1]);
      }
    }
  }
  for (const auto& layer : fused_layers) {  // the router, "mlp.gate.weight": under the family's name
    const auto it = out.find(layer + "mlp.gate.weight");
    const std::string name = layer + o.prefix + o.router + ".weight";
    if (it == out.end() || it->first == name) continue;
    auto router = it->second;
    out.erase(it);
    out.emplace(name, router);
  }
  tensors = std::move(out);
}

/// Every tensor of the folder's weight files, by their own names.
std::map<std::string, torch::Tensor> read_weight_files(const fs::path& dir) {
  std::vector<fs::path> files;
  for (const char* index : {"model.safetensors.index.json", "pytorch_model.bin.index.json"})
    if (fs::exists(dir / index) && !fs::exists(dir / (std::string(index).substr(0, std::string(index).size() - 11)))) {
      const auto j = read_json(dir / index);
      if (!j.contains("weight_map") || !j.at("weight_map").is_object())
        throw checkpoint_error((dir / index).string() + " has no weight_map");
      std::set<std::string> names;
      for (const auto& [tensor, file] : j.at("weight_map").items()) names.insert(file.get<std::string>());
      for (const auto& n : names) files.push_back(dir / n);
      break;
    }
  if (files.empty())
    for (const char* single : {"model.safetensors", "pytorch_model.bin"})
      if (fs::exists(dir / single)) {
        files.push_back(dir / single);
        break;
      }
  if (files.empty())
    throw checkpoint_error("Hugging Face folder " + dir.string() +
                           " has no weights: no model.safetensors, model.safetensors.index.json or pytorch_model.bin");
  std::map<std::string, torch::Tensor> out;
  for (const auto& f : files) {
    if (!fs::exists(f)) throw checkpoint_error("Hugging Face folder " + dir.string() + ": its index names " + f.filename().string() + ", which is missing");
    named_tensors tensors;
    try {
      tensors = ends_with(f.string(), ".bin") ? load_state_dict(f.string()) : read_safetensors(f.string());
    } catch (const checkpoint_error&) {
      throw;
    } catch (const std::exception& e) {
      throw checkpoint_error(e.what());
    }
    for (auto& [name, t] : tensors)
      if (!out.emplace(name, t).second)
        throw checkpoint_error("Hugging Face folder " + dir.string() + ": tensor " + name + " is in two files");
  }
  return out;
}

}  // namespace

namespace {

/// The source folder's config.json (train.model), or an empty object.
nlohmann::json source_config(const std::string& source) {
  if (source.empty() || !fs::exists(fs::path(source) / "config.json")) return nlohmann::json::object();
  auto c = read_json(fs::path(source) / "config.json");
  return c.is_object() ? c : nlohmann::json::object();
}

/// Whether a config.json is in transformers 5.x's spelling (rope_parameters, dtype).
bool spelled_5x(const nlohmann::json& c) {
  if (c.contains("rope_parameters")) return true;
  if (c.contains("dtype") && !c.contains("torch_dtype")) return true;
  const auto v = c.find("transformers_version");
  return v != c.end() && v->is_string() && v->get<std::string>().rfind("5.", 0) == 0;
}

/// The rotary scaling as config.json writes it: null, or {"rope_type": ..., its numbers}.
nlohmann::ordered_json rope_json(const rope_scaling& r) {
  nlohmann::ordered_json j;
  switch (r.type) {
    case rope_scaling::kind::none: return nullptr;
    case rope_scaling::kind::linear:
      j["rope_type"] = "linear";
      j["factor"] = r.factor;
      return j;
    case rope_scaling::kind::llama3:
      j["rope_type"] = "llama3";
      j["factor"] = r.factor;
      j["low_freq_factor"] = r.low_freq_factor;
      j["high_freq_factor"] = r.high_freq_factor;
      j["original_max_position_embeddings"] = r.original_positions;
      return j;
  }
  return nullptr;
}

const char* architecture_class(const std::string& type) {
  if (type == "llama") return "LlamaForCausalLM";
  if (type == "mistral") return "MistralForCausalLM";
  if (type == "mixtral") return "MixtralForCausalLM";
  if (type == "qwen2") return "Qwen2ForCausalLM";
  if (type == "qwen3") return "Qwen3ForCausalLM";
  if (type == "qwen3_moe") return "Qwen3MoeForCausalLM";
  return "GPT2LMHeadModel";
}

}  // namespace

nlohmann::ordered_json hf_config(const model_spec& spec, const hf_export_options& opts) {
  if (spec.type != model_spec::kind::decoder) throw std::invalid_argument("only the decoders export to Hugging Face folders");
  const auto& g = spec.decoder;
  const std::int64_t vocab = opts.vocab > 0 ? opts.vocab : g.vocab_used > 0 ? g.vocab_used : g.vocab;
  const auto source = source_config(opts.source);
  const bool v5 = spelled_5x(source);
  const std::string type = hf_model_type(spec);
  nlohmann::ordered_json c;
  c["architectures"] = {architecture_class(type)};
  c["model_type"] = type;
  c["vocab_size"] = vocab;
  if (spec.is_llama()) {
    const bool mixtral = type == "mixtral", qwen_moe = type == "qwen3_moe";
    c["hidden_size"] = g.d_model;
    c["intermediate_size"] = mixtral ? g.expert_d_ff() : g.d_ff;
    if (mixtral) {
      c["num_local_experts"] = g.n_experts;
      c["num_experts_per_tok"] = g.moe_top_k;
      c["router_aux_loss_coef"] = g.moe_aux_coeff;
      c["output_router_logits"] = false;
      c["router_jitter_noise"] = 0.0;
    }
    if (qwen_moe) {
      c[v5 ? "num_local_experts" : "num_experts"] = g.n_experts;
      c["num_experts_per_tok"] = g.moe_top_k;
      c["moe_intermediate_size"] = g.expert_d_ff();
      c["norm_topk_prob"] = g.moe_norm_topk;
      // Any blocks with experts: step 1 and the others listed as dense.
      c["decoder_sparse_step"] = 1;
      std::vector<int> dense;
      for (int i = 0; i < g.n_layer; ++i)
        if (!g.is_moe_block(i)) dense.push_back(i);
      c["mlp_only_layers"] = dense;
      c["router_aux_loss_coef"] = g.moe_aux_coeff;
      c["output_router_logits"] = false;
    }
    c["num_hidden_layers"] = g.n_layer;
    c["num_attention_heads"] = g.n_head;
    c["num_key_value_heads"] = g.kv_heads();
    c["head_dim"] = g.head_dim();
    c["hidden_act"] = "silu";
    // The source's positions (a model fine-tuned on shorter sequences keeps its own).
    const auto positions = source.find("max_position_embeddings");
    c["max_position_embeddings"] =
        positions != source.end() && positions->is_number_integer() && positions->get<int>() >= g.seq_len
            ? positions->get<int>()
            : g.seq_len;
    c["rms_norm_eps"] = g.norm_eps;  // (the families' defaults differ)
    if (v5) {
      auto rope = rope_json(g.rope);
      if (rope.is_null()) rope = {{"rope_type", "default"}};
      nlohmann::ordered_json params{{"rope_theta", g.rope_theta}};
      for (const auto& [k, v] : rope.items()) params[k] = v;
      c["rope_parameters"] = params;
    } else {
      c["rope_theta"] = g.rope_theta;
      c["rope_scaling"] = rope_json(g.rope);
    }
    if (type == "mistral" || type == "mixtral") {
      c["sliding_window"] = g.sliding_window > 0 ? nlohmann::ordered_json(g.sliding_window) : nlohmann::ordered_json(nullptr);
    } else if (type != "llama") {  // Qwen's: off
      c["use_sliding_window"] = false;
      c["sliding_window"] = nullptr;
      c["max_window_layers"] = g.n_layer;
    }
    if (type == "llama" || type == "qwen3" || type == "qwen3_moe") c["attention_bias"] = false;
    if (type == "llama") c["mlp_bias"] = false;
    c["attention_dropout"] = 0.0;
    c["initializer_range"] = 0.02;
  } else {
    c["n_embd"] = g.d_model;
    c["n_inner"] = g.d_ff;
    c["n_layer"] = g.n_layer;
    c["n_head"] = g.n_head;
    c["n_positions"] = g.seq_len;
    c["n_ctx"] = g.seq_len;
    // The exact GELU, or the tanh form (GPT2Config's default gelu_new, real GPT-2's)
    c["activation_function"] = g.gelu_tanh ? "gelu_new" : "gelu";
    c["layer_norm_epsilon"] = g.norm_eps;
    c["resid_pdrop"] = 0.0;
    c["embd_pdrop"] = 0.0;
    c["attn_pdrop"] = 0.0;
    c["scale_attn_weights"] = true;
    c["scale_attn_by_inverse_layer_idx"] = false;
    c["reorder_and_upcast_attn"] = false;
    c["initializer_range"] = 0.02;
  }
  c["tie_word_embeddings"] = g.tie_embeddings;
  // The source's special tokens (none: bytes, or a tokenizer's pieces, with none).
  for (const char* id : {"bos_token_id", "eos_token_id", "pad_token_id"}) {
    const auto it = source.find(id);
    if (it != source.end()) c[id] = *it;
    else if (std::string(id) != "pad_token_id") c[id] = nullptr;
  }
  c[v5 ? "dtype" : "torch_dtype"] = dtype_name(opts.dtype);
  return c;
}

std::size_t export_hf_folder(const std::string& dir, const model_spec& spec, const state_dict& state,
                             const hf_export_options& opts) {
  check_state(spec, state);
  const auto& g = spec.decoder;
  for (int i = 0; g.n_experts > 0 && hf_model_type(spec) == "mixtral" && i < g.n_layer; ++i)
    if (!g.is_moe_block(i))
      throw checkpoint_error("Hugging Face folder " + dir + ": a Mixtral folder makes every block's MLP experts; this "
                             "model's block " + std::to_string(i) + " is dense (moe_every " +
                             std::to_string(g.moe_every) + "), which Hugging Face's Mixtral cannot load");
  const auto config = hf_config(spec, opts);
  const std::int64_t vocab = config.at("vocab_size").get<std::int64_t>();
  if (vocab > spec.decoder.vocab)
    throw std::invalid_argument("export vocab " + std::to_string(vocab) + " exceeds the model's " +
                                std::to_string(spec.decoder.vocab) + " rows");
  named_tensors out;
  for (const auto& [name, t] : state) {
    auto w = t.detach().to(torch::kCPU, torch::kFloat32);
    if (vocab_rows(spec, name)) w = w.narrow(0, 0, vocab);  // padded rows are not the tokenizer's
    if (!spec.is_llama() && conv1d_weight(name)) w = w.t();
    const std::string hf_name = spec.is_llama() || name == "lm_head.weight" ? name : "transformer." + name;
    out.emplace_back(hf_name, w.to(opts.dtype).contiguous());
  }
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw checkpoint_error("cannot make folder " + dir + ": " + ec.message());
  write_safetensors((fs::path(dir) / "model.safetensors").string(), out);
  fs::remove(fs::path(dir) / "model.safetensors.index.json", ec);  // a stale index would name other shards
  write_file_atomically((fs::path(dir) / "config.json").string(), config.dump(2) + "\n");
  // generation_config.json: the source's, else the special tokens of config.json.
  const fs::path source(opts.source);
  if (!opts.source.empty() && fs::exists(source / "generation_config.json")) {
    copy_file_atomically((source / "generation_config.json").string(), (fs::path(dir) / "generation_config.json").string());
  } else {
    nlohmann::ordered_json gen{{"_from_model_config", true}};
    for (const char* id : {"bos_token_id", "eos_token_id", "pad_token_id"})
      if (config.contains(id)) gen[id] = config.at(id);
    write_file_atomically((fs::path(dir) / "generation_config.json").string(), gen.dump(2) + "\n");
  }
  // The source's tokenizer, whichever files it has (AutoTokenizer reads them unchanged).
  if (!opts.source.empty())
    for (const char* file : {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                             "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json"})
      if (fs::exists(source / file)) copy_file_atomically((source / file).string(), (fs::path(dir) / file).string());
  if (!opts.tokenizer.empty())  // the pieces the model was trained on
    copy_file_atomically(opts.tokenizer, (fs::path(dir) / "tokenizer.model").string());
  return out.size();
}

hf_model_shape read_hf_model_shape(const std::string& dir) {
  const fs::path p(dir);
  if (!fs::is_directory(p)) throw checkpoint_error("Hugging Face folder " + dir + " is not a folder");
  if (!fs::exists(p / "config.json")) throw checkpoint_error("Hugging Face folder " + dir + " has no config.json");
  const auto c = read_json(p / "config.json");
  const std::string where = "Hugging Face folder " + dir + ": config.json";
  if (!c.is_object()) throw checkpoint_error(where + " is not a JSON object");
  std::vector<std::string> problems;
  // (A sliding window is checked against the job's seq_len when the weights are read.)
  auto out = parse_config(c, 0, problems);
  if (!problems.empty()) {
    std::string msg = where + ": ";
    for (std::size_t i = 0; i < problems.size(); ++i) msg += (i ? "; " : "") + problems[i];
    throw checkpoint_error(msg);
  }
  return out;
}

const char* hf_families() { return "llama, mistral, mixtral, qwen2, qwen3, qwen3_moe, gpt2"; }

bool is_hf_folder(const std::string& dir) {
  const fs::path p(dir);
  return fs::is_directory(p) && fs::exists(p / "config.json") && !fs::exists(p / "manifest.json") &&
         !fs::exists(p / "latest");
}

state_dict read_hf_folder(const std::string& dir, const model_spec& spec) {
  if (spec.type != model_spec::kind::decoder)
    throw checkpoint_error("Hugging Face folder " + dir + ": only the decoder workloads read them");
  const fs::path p(dir);
  if (!fs::exists(p / "config.json")) throw checkpoint_error("Hugging Face folder " + dir + " has no config.json");
  const auto config = read_json(p / "config.json");
  check_config(dir, config, spec);
  const std::int64_t vocab = config.at("vocab_size").get<std::int64_t>();
  auto tensors = read_weight_files(p);
  if (spec.decoder.n_experts > 0) unfuse_experts(dir, spec, tensors);
  const std::string embedding = spec.is_llama() ? "model.embed_tokens.weight" : "wte.weight";
  state_dict out;
  torch::Tensor lm_head;
  for (const auto& [hf_name, t] : tensors) {
    std::string name = hf_name;
    if (!spec.is_llama() && name.rfind("transformer.", 0) == 0) name = name.substr(12);
    // Buffers some versions save: the causal masks of GPT-2, the rotary frequencies of Llama.
    if (ends_with(name, ".attn.bias") || ends_with(name, ".attn.masked_bias") || ends_with(name, "rotary_emb.inv_freq"))
      continue;
    if (!t.is_floating_point())
      throw checkpoint_error("Hugging Face folder " + dir + ": tensor " + hf_name + " holds " +
                             c10::toString(t.scalar_type()) + " values, not floating-point weights");
    auto w = t.to(torch::kFloat32);
    if (!spec.is_llama() && conv1d_weight(name)) {
      if (w.dim() != 2)
        throw checkpoint_error("Hugging Face folder " + dir + ": tensor " + hf_name + " has " + std::to_string(w.dim()) +
                               " dimensions, expected a 2-D Conv1D weight");
      w = w.t();
    }
    if (vocab_rows(spec, name)) {
      if (w.dim() != 2 || w.size(0) != vocab)
        throw checkpoint_error("Hugging Face folder " + dir + ": tensor " + hf_name + " has shape " +
                               c10::str(w.sizes()) + ", expected " + std::to_string(vocab) + " rows (vocab_size)");
      if (vocab < spec.decoder.vocab)  // the model's padded rows, which no token uses
        w = torch::cat({w, torch::zeros({spec.decoder.vocab - vocab, w.size(1)})});
    }
    if (name == "lm_head.weight" && spec.decoder.tie_embeddings) {
      lm_head = w;  // the tied output layer, saved anyway: it must be the embedding
      continue;
    }
    out.emplace_back(name, w.contiguous());
  }
  if (lm_head.defined()) {
    const auto it = std::find_if(out.begin(), out.end(), [&](const auto& kv) { return kv.first == embedding; });
    if (it != out.end() && !torch::equal(it->second, lm_head))
      throw checkpoint_error("Hugging Face folder " + dir + ": lm_head.weight differs from the embedding, which the " +
                             "model ties it to (tie_word_embeddings)");
  }
  // In the model's canonical order; the checks name every missing, unexpected or mis-shaped tensor.
  try {
    check_state(spec, out);
  } catch (const model_error& e) {
    throw checkpoint_error("Hugging Face folder " + dir + ": " + e.what());
  }
  std::map<std::string, torch::Tensor> by_name(out.begin(), out.end());
  state_dict ordered;
  for (const auto& name : parameter_names(spec)) ordered.emplace_back(name, by_name.at(name));
  return ordered;
}

state_dict read_initial_weights(const std::string& path, const model_spec& spec) {
  if (fs::is_directory(path)) {
    if (!fs::exists(fs::path(path) / "config.json"))
      throw checkpoint_error("initial weights " + path + " is a folder without config.json (not a Hugging Face model folder)");
    return read_hf_folder(path, spec);
  }
  return load_state_dict(path);
}

}  // namespace troupe
