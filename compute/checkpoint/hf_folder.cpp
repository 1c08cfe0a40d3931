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

/// config.json's model_type for the model: gpt2, llama, or mixtral (llama with experts).
std::string hf_model_type(const model_spec& spec) {
  return !spec.is_llama() ? "gpt2" : spec.decoder.n_experts > 0 ? "mixtral" : "llama";
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

/// The rotary embedding's base in config.json, in both spellings: transformers 4.x writes
/// `rope_theta` and `rope_scaling` at the top level, 5.x one `rope_parameters` object
/// ({"rope_theta": ..., "rope_type": ...}). Troupe's rotary embedding is the default one
/// (no scaling, every dimension of a head rotated): any other rope_type or a partial
/// rotation goes into `problems`, never read as the default.
double rotary_base(const nlohmann::json& c, std::vector<std::string>& problems) {
  double theta = 10000;
  auto read_theta = [&](const nlohmann::json& j, const std::string& key) {
    const auto it = j.find("rope_theta");
    if (it == j.end() || it->is_null()) return;
    if (!it->is_number()) {
      problems.push_back(key + " " + it->dump() + " (expected a number)");
      return;
    }
    theta = it->get<double>();
  };
  read_theta(c, "rope_theta");
  auto check_kind = [&](const nlohmann::json& j, const std::string& key) {
    if (j.is_null()) return;
    if (!j.is_object()) {
      problems.push_back(key + " " + j.dump() + " (expected an object)");
      return;
    }
    // 4.x's rope_scaling names it "rope_type" (older files "type").
    std::string kind = "default";
    for (const char* name : {"rope_type", "type"})
      if (j.contains(name) && j.at(name).is_string()) {
        kind = j.at(name).get<std::string>();
        break;
      }
    if (kind != "default")
      problems.push_back(key + " rope_type " + kind + " (Troupe's rotary embedding is the default one, unscaled)");
    const auto partial = j.find("partial_rotary_factor");
    if (partial != j.end() && partial->is_number() && partial->get<double>() != 1)
      problems.push_back(key + " partial_rotary_factor " + partial->dump() + " (Troupe rotates every dimension)");
  };
  if (const auto it = c.find("rope_scaling"); it != c.end()) check_kind(*it, "rope_scaling");
  if (const auto it = c.find("rope_parameters"); it != c.end()) {
    check_kind(*it, "rope_parameters");
    if (it->is_object()) read_theta(*it, "rope_parameters.rope_theta");
  }
  if (const auto it = c.find("partial_rotary_factor"); it != c.end() && it->is_number() && it->get<double>() != 1)
    problems.push_back("partial_rotary_factor " + it->dump() + " (Troupe rotates every dimension)");
  return theta;
}

/// Fields that change the computation and that Troupe's blocks of the family (llama's or
/// gpt2's) do not have, for a job of `seq_len` tokens (0: no window is checked): refused
/// by name, never ignored.
void unsupported_fields(const nlohmann::json& c, bool llama, int seq_len, std::vector<std::string>& problems) {
  if (!llama) {
    const std::string act = c.value("activation_function", std::string("gelu_new"));
    if (act != "gelu")
      problems.push_back("activation_function " + act + " (Troupe's gpt2 uses the exact GELU, \"gelu\"" +
                         (act == "gelu_new" ? "; gelu_new is the tanh approximation" : "") + ")");
    return;
  }
  if (const auto act = c.value("hidden_act", std::string("silu")); act != "silu")
    problems.push_back("hidden_act " + act + " (llama's MLP is SwiGLU: silu)");
  for (const char* bias : {"attention_bias", "mlp_bias"})
    if (c.value(bias, false)) problems.push_back(std::string(bias) + " true (llama has no biases)");
  for (const char* key : {"attn_logit_softcapping", "final_logit_softcapping", "attention_dropout",
                          "router_jitter_noise", "shared_expert_intermediate_size"}) {
    const auto it = c.find(key);
    if (it != c.end() && !it->is_null() && !(it->is_number() && it->get<double>() == 0))
      problems.push_back(std::string(key) + " " + it->dump() + " (Troupe's blocks have none)");
  }
  const auto window = c.find("sliding_window");
  if (seq_len > 0 && window != c.end() && window->is_number() && window->get<double>() < seq_len &&
      c.value("use_sliding_window", true))
    problems.push_back("sliding_window " + window->dump() + " (shorter than the job's seq_len " + std::to_string(seq_len) +
                       "; Troupe's attention sees the whole sequence)");
}

/// config.json against the job's model: every field that shapes the weights or the
/// computation must agree.
void check_config(const std::string& dir, const nlohmann::json& c, const model_spec& spec) {
  const auto& g = spec.decoder;
  const std::string type = c.value("model_type", std::string("(none)"));
  const std::string want = hf_model_type(spec);
  // Mistral's blocks are Llama's (a sliding window shorter than the sequence is refused below).
  if (type != want && !(type == "mistral" && want == "llama"))
    throw checkpoint_error("Hugging Face folder " + dir + " holds a " + type + " model (config.json model_type); the job's model is " +
                           want +
                           (type == "llama" || type == "mistral" || type == "mixtral" || type == "gpt2"
                                ? ": --model " + dir + " trains the folder's own model"
                                : ""));
  std::vector<std::string> differ;
  auto number = [&](const char* key, double fallback) {
    const auto it = c.find(key);
    return it == c.end() || it->is_null() ? fallback : it->get<double>();
  };
  auto same_int = [&](const char* key, double fallback, std::int64_t mine, const char* ours) {
    const double theirs = number(key, fallback);
    if (theirs != double(mine))
      differ.push_back(std::string(key) + " " + std::to_string(std::int64_t(theirs)) + " (the job's " + ours + " " +
                       std::to_string(mine) + ")");
  };
  auto same_real = [&](const char* key, double fallback, double mine, const char* ours) {
    const double theirs = number(key, fallback);
    if (std::abs(theirs - mine) > 1e-9 * std::max(1.0, std::abs(mine))) {
      std::ostringstream o;
      o << key << " " << theirs << " (the job's " << ours << " " << mine << ")";
      differ.push_back(o.str());
    }
  };
  const auto vocab = std::int64_t(number("vocab_size", -1));
  if (vocab < 1 || vocab > g.vocab)
    differ.push_back("vocab_size " + std::to_string(vocab) + " (the job's vocab " + std::to_string(g.vocab) +
                     ": at most that many rows)");
  const bool default_tie = !spec.is_llama();  // LlamaConfig's default is untied, GPT2Config's tied
  const bool tied = c.contains("tie_word_embeddings") && !c.at("tie_word_embeddings").is_null()
                        ? c.at("tie_word_embeddings").get<bool>()
                        : default_tie;
  if (tied != g.tie_embeddings)
    differ.push_back(std::string("tie_word_embeddings ") + (tied ? "true" : "false") + " (the job's tie_embeddings " +
                     (g.tie_embeddings ? "true" : "false") + ")");
  if (spec.is_llama()) {
    same_int("hidden_size", -1, g.d_model, "d_model");
    if (g.n_experts > 0) {  // Mixtral: every block's MLP is the experts
      same_int("intermediate_size", -1, g.expert_d_ff(), "moe_d_ff");
      same_int("num_local_experts", 8, g.n_experts, "experts");
      same_int("num_experts_per_tok", 2, g.moe_top_k, "moe_top_k");
    } else {
      same_int("intermediate_size", -1, g.d_ff, "d_ff");
    }
    same_int("num_hidden_layers", -1, g.n_layer, "layers");
    same_int("num_attention_heads", -1, g.n_head, "heads");
    same_int("num_key_value_heads", number("num_attention_heads", -1), g.kv_heads(), "kv_heads");
    same_int("head_dim", g.head_dim(), g.head_dim(), "d_model / heads");
    same_real("rms_norm_eps", 1e-6, g.norm_eps, "norm_eps");
    const double theta = rotary_base(c, differ);
    if (std::abs(theta - g.rope_theta) > 1e-9 * std::max(1.0, std::abs(g.rope_theta))) {
      std::ostringstream o;
      o << "rope_theta " << theta << " (the job's rope_theta " << g.rope_theta << ")";
      differ.push_back(o.str());
    }
    unsupported_fields(c, true, g.seq_len, differ);
  } else {
    same_int("n_embd", -1, g.d_model, "d_model");
    same_int("n_inner", 4 * number("n_embd", -1), g.d_ff, "d_ff");
    same_int("n_layer", -1, g.n_layer, "layers");
    same_int("n_head", -1, g.n_head, "heads");
    same_int("n_positions", -1, g.seq_len, "seq_len");
    same_real("layer_norm_epsilon", 1e-5, g.norm_eps, "norm_eps");
    unsupported_fields(c, false, 0, differ);
  }
  if (!differ.empty()) {
    std::string msg = "Hugging Face folder " + dir + ": config.json disagrees with the job's model: ";
    for (std::size_t i = 0; i < differ.size(); ++i) msg += (i ? "; " : "") + differ[i];
    throw checkpoint_error(msg);
  }
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

nlohmann::ordered_json hf_config(const model_spec& spec, const hf_export_options& opts) {
  if (spec.type != model_spec::kind::decoder) throw std::invalid_argument("only the decoders export to Hugging Face folders");
  const auto& g = spec.decoder;
  const std::int64_t vocab = opts.vocab > 0 ? opts.vocab : g.vocab_used > 0 ? g.vocab_used : g.vocab;
  nlohmann::ordered_json c;
  if (spec.is_llama()) {
    const bool mixtral = g.n_experts > 0;
    c["architectures"] = {mixtral ? "MixtralForCausalLM" : "LlamaForCausalLM"};
    c["model_type"] = hf_model_type(spec);
    c["vocab_size"] = vocab;
    c["hidden_size"] = g.d_model;
    c["intermediate_size"] = mixtral ? g.expert_d_ff() : g.d_ff;
    if (mixtral) {
      c["num_local_experts"] = g.n_experts;
      c["num_experts_per_tok"] = g.moe_top_k;
      c["router_aux_loss_coef"] = g.moe_aux_coeff;
      c["output_router_logits"] = false;
      c["router_jitter_noise"] = 0.0;
      c["sliding_window"] = nullptr;
    }
    c["num_hidden_layers"] = g.n_layer;
    c["num_attention_heads"] = g.n_head;
    c["num_key_value_heads"] = g.kv_heads();
    c["head_dim"] = g.head_dim();
    c["hidden_act"] = "silu";
    c["max_position_embeddings"] = g.seq_len;
    c["rms_norm_eps"] = g.norm_eps;  // (LlamaConfig's default is 1e-6)
    c["rope_theta"] = g.rope_theta;
    c["rope_scaling"] = nullptr;
    c["attention_bias"] = false;
    c["attention_dropout"] = 0.0;
    c["mlp_bias"] = false;
    c["initializer_range"] = 0.02;
  } else {
    c["architectures"] = {"GPT2LMHeadModel"};
    c["model_type"] = "gpt2";
    c["vocab_size"] = vocab;
    c["n_embd"] = g.d_model;
    c["n_inner"] = g.d_ff;
    c["n_layer"] = g.n_layer;
    c["n_head"] = g.n_head;
    c["n_positions"] = g.seq_len;
    c["n_ctx"] = g.seq_len;
    c["activation_function"] = "gelu";  // the exact GELU (GPT2Config's default gelu_new is the tanh form)
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
  c["bos_token_id"] = nullptr;  // bytes (or a tokenizer's pieces) with no special tokens
  c["eos_token_id"] = nullptr;
  c["torch_dtype"] = dtype_name(opts.dtype);
  return c;
}

std::size_t export_hf_folder(const std::string& dir, const model_spec& spec, const state_dict& state,
                             const hf_export_options& opts) {
  check_state(spec, state);
  if (spec.decoder.n_experts > 0 && spec.decoder.moe_every != 1)
    throw checkpoint_error("Hugging Face folder " + dir + ": a Mixtral folder makes every block's MLP experts; this "
                           "model has experts in every " + std::to_string(spec.decoder.moe_every) +
                           "th block only (moe_every), which Hugging Face's Mixtral cannot load");
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
  return out.size();
}

hf_model_shape read_hf_model_shape(const std::string& dir) {
  const fs::path p(dir);
  if (!fs::is_directory(p)) throw checkpoint_error("Hugging Face folder " + dir + " is not a folder");
  if (!fs::exists(p / "config.json")) throw checkpoint_error("Hugging Face folder " + dir + " has no config.json");
  const auto c = read_json(p / "config.json");
  const std::string where = "Hugging Face folder " + dir + ": config.json";
  if (!c.is_object()) throw checkpoint_error(where + " is not a JSON object");
  const auto type_it = c.find("model_type");
  const std::string type = type_it != c.end() && type_it->is_string() ? type_it->get<std::string>() : "";
  hf_model_shape out;
  out.model_type = type;
  auto& g = out.decoder;
  std::vector<std::string> problems;
  // A positive integer field; `fallback` (0: none) when it is missing or null.
  auto integer = [&](const char* key, int fallback) -> int {
    const auto it = c.find(key);
    if (it == c.end() || it->is_null()) {
      if (fallback <= 0) problems.push_back(std::string("no ") + key);
      return fallback;
    }
    if (!it->is_number_integer() || it->get<long long>() < 1 || it->get<long long>() > (1LL << 30)) {
      problems.push_back(std::string(key) + " " + it->dump() + " (expected a positive integer)");
      return fallback;
    }
    return int(it->get<long long>());
  };
  auto real = [&](const char* key, double fallback) -> double {
    const auto it = c.find(key);
    if (it == c.end() || it->is_null()) return fallback;
    if (!it->is_number() || it->get<double>() <= 0) {
      problems.push_back(std::string(key) + " " + it->dump() + " (expected a positive number)");
      return fallback;
    }
    return it->get<double>();
  };
  auto boolean = [&](const char* key, bool fallback) -> bool {
    const auto it = c.find(key);
    if (it == c.end() || it->is_null()) return fallback;
    if (!it->is_boolean()) {
      problems.push_back(std::string(key) + " " + it->dump() + " (expected true or false)");
      return fallback;
    }
    return it->get<bool>();
  };
  if (type == "llama" || type == "mistral" || type == "mixtral") {
    g.arch = decoder_arch::llama;
    g.d_model = integer("hidden_size", 0);
    g.n_layer = integer("num_hidden_layers", 0);
    g.n_head = integer("num_attention_heads", 0);
    g.n_kv_head = integer("num_key_value_heads", g.n_head);
    g.d_ff = integer("intermediate_size", 0);
    g.vocab = integer("vocab_size", 0);
    g.norm_eps = real("rms_norm_eps", 1e-6);  // LlamaConfig's and MixtralConfig's default
    g.tie_embeddings = boolean("tie_word_embeddings", false);
    g.rope_theta = rotary_base(c, problems);
    out.max_positions = c.contains("max_position_embeddings") ? integer("max_position_embeddings", 0) : 0;
    if (g.n_head > 0 && g.d_model % g.n_head != 0)
      problems.push_back("hidden_size " + std::to_string(g.d_model) + " is not a multiple of num_attention_heads " +
                         std::to_string(g.n_head));
    if (g.n_head > 0 && g.n_kv_head > 0 && g.n_head % g.n_kv_head != 0)
      problems.push_back("num_attention_heads " + std::to_string(g.n_head) + " is not a multiple of num_key_value_heads " +
                         std::to_string(g.n_kv_head));
    if (const auto it = c.find("head_dim"); it != c.end() && !it->is_null() && g.n_head > 0 &&
                                            !(it->is_number_integer() && it->get<long long>() == g.d_model / g.n_head))
      problems.push_back("head_dim " + it->dump() + " (Troupe's heads are hidden_size / num_attention_heads = " +
                         std::to_string(g.d_model / g.n_head) + ")");
    unsupported_fields(c, true, 0, problems);  // (a sliding window: against the job's seq_len on reading)
    if (type == "mixtral") {
      g.n_experts = integer("num_local_experts", 8);
      g.moe_top_k = integer("num_experts_per_tok", 2);
      g.moe_d_ff = g.d_ff;
      g.moe_every = 1;
      g.moe_aux_coeff = 0.001;  // MixtralConfig's router_aux_loss_coef
      if (const auto it = c.find("router_aux_loss_coef"); it != c.end() && !it->is_null()) {
        if (it->is_number() && it->get<double>() >= 0)
          g.moe_aux_coeff = it->get<double>();
        else
          problems.push_back("router_aux_loss_coef " + it->dump() + " (expected a number, 0 or more)");
      }
      if (g.moe_top_k > g.n_experts)
        problems.push_back("num_experts_per_tok " + std::to_string(g.moe_top_k) + " is above num_local_experts " +
                           std::to_string(g.n_experts));
    }
  } else if (type == "gpt2") {
    g.arch = decoder_arch::gpt2;
    g.d_model = integer("n_embd", 0);
    g.n_layer = integer("n_layer", 0);
    g.n_head = integer("n_head", 0);
    g.d_ff = integer("n_inner", 4 * std::max(g.d_model, 1));
    g.vocab = integer("vocab_size", 0);
    g.seq_len = out.max_positions = integer("n_positions", 0);
    g.norm_eps = real("layer_norm_epsilon", 1e-5);
    g.tie_embeddings = boolean("tie_word_embeddings", true);
    if (g.n_head > 0 && g.d_model % g.n_head != 0)
      problems.push_back("n_embd " + std::to_string(g.d_model) + " is not a multiple of n_head " + std::to_string(g.n_head));
    unsupported_fields(c, false, 0, problems);
  } else {
    throw checkpoint_error(where + ": model_type " + (type.empty() ? "(none)" : "'" + type + "'") +
                           " is not a family Troupe reads (llama, mistral, mixtral, gpt2)");
  }
  if (!problems.empty()) {
    std::string msg = where + ": ";
    for (std::size_t i = 0; i < problems.size(); ++i) msg += (i ? "; " : "") + problems[i];
    throw checkpoint_error(msg);
  }
  return out;
}

bool is_hf_folder(const std::string& dir) {
  const fs::path p(dir);
  return fs::is_directory(p) && fs::exists(p / "config.json") && !fs::exists(p / "manifest.json") &&
         !fs::exists(p / "latest");
}

state_dict read_hf_folder(const std::string& dir, const model_spec& spec) {
  if (spec.type != model_spec::kind::decoder)
    throw checkpoint_error("Hugging Face folder " + dir + ": only the decoder workloads read them");
  if (spec.decoder.n_experts > 0 && spec.decoder.moe_every != 1)
    throw checkpoint_error("Hugging Face folder " + dir + ": a Mixtral folder has experts in every block; the job's "
                           "model has them in every " + std::to_string(spec.decoder.moe_every) + "th (moe_every)");
  const fs::path p(dir);
  if (!fs::exists(p / "config.json")) throw checkpoint_error("Hugging Face folder " + dir + " has no config.json");
  const auto config = read_json(p / "config.json");
  check_config(dir, config, spec);
  const std::int64_t vocab = config.at("vocab_size").get<std::int64_t>();
  const auto tensors = read_weight_files(p);
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
