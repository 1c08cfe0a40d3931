#include "compute/models/parameters.hpp"

#include <cctype>
#include <cmath>
#include <map>
#include <sstream>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include "compute/models/block.hpp"
#include "compute/models/family.hpp"
#include "compute/models/parts/norm.hpp"
#include "compute/models/parts/positions.hpp"

namespace troupe {

namespace {

/// The token embedding (and learned positions) of the first slice.
param_table embedding_params(const decoder_config& c) {
  const auto& f = family_of(c.arch);
  param_table out{{f.token_embedding, {c.vocab, c.d_model}, param_spec::init::normal, 0.02, true, tp_split::rows}};
  if (f.positions == position_kind::learned) {
    const auto pos = learned_position_params(f.position_embedding, c.seq_len, c.d_model);
    out.insert(out.end(), pos.begin(), pos.end());
  }
  return out;
}

/// The final norm, and the output layer when it is not the tied embedding.
param_table head_params(const decoder_config& c) {
  const auto& f = family_of(c.arch);
  auto out = norm_params(f.norm, f.final_norm, c.d_model);
  if (!c.tie_embeddings)
    out.push_back({f.output, {c.vocab, c.d_model}, param_spec::init::normal, 0.02, true, tp_split::rows});
  return out;
}

param_table mlp_layer_params(const std::vector<int>& w, int i) {
  const std::string p = "net." + std::to_string(2 * i) + ".";
  using I = param_spec::init;
  // PyTorch's default Linear init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weight and bias.
  return {{p + "weight", {w[i + 1], w[i]}, I::uniform_fan_in, 0, false},
          {p + "bias", {w[i + 1]}, I::uniform_fan_in, 0, false}};
}

std::string shape_str(c10::IntArrayRef s) {
  std::ostringstream o;
  o << s;
  return o.str();
}

}  // namespace

param_table all_params(const model_spec& spec) {
  param_table out;
  auto append = [&](const param_table& v) { out.insert(out.end(), v.begin(), v.end()); };
  if (spec.type == model_spec::kind::decoder) {
    append(embedding_params(spec.decoder));
    for (int i = 0; i < spec.decoder.n_layer; ++i) append(block_params(family_of(spec.decoder.arch), spec.decoder, i));
    append(head_params(spec.decoder));
  } else {
    for (int i = 0; i < spec.n_layers(); ++i) append(mlp_layer_params(spec.mlp_widths, i));
  }
  return out;
}

param_spec spec_of(const model_spec& spec, const std::string& name) {
  for (auto& p : all_params(spec))
    if (p.name == name) return p;
  return {};
}

std::map<std::string, param_spec> rows_by_name(const model_spec& spec) {
  std::map<std::string, param_spec> out;
  for (auto& p : all_params(spec)) out.emplace(p.name, p);
  return out;
}

tp_split tp_split_of(const model_spec& spec, const std::string& name) { return spec_of(spec, name).split; }

std::vector<std::string> parameter_names(const model_spec& spec) {
  std::vector<std::string> out;
  for (const auto& p : all_params(spec)) out.push_back(p.name);
  return out;
}

std::vector<std::string> slice_parameter_names(const model_spec& spec, const layer_range& range) {
  std::vector<std::string> names;
  if (spec.type != model_spec::kind::decoder) {
    for (int i = range.first; i < range.last; ++i)
      for (const auto& p : mlp_layer_params(spec.mlp_widths, i)) names.push_back(p.name);
    return names;
  }
  if (range.first_slice)
    for (const auto& p : embedding_params(spec.decoder)) names.push_back(p.name);
  else if (range.last_slice && !tied_parameter(spec).empty())
    names.push_back(tied_parameter(spec));  // the tied output layer's copy
  for (int i = range.first; i < range.last; ++i)
    for (const auto& p : block_params(family_of(spec.decoder.arch), spec.decoder, i)) names.push_back(p.name);
  if (range.last_slice)
    for (const auto& p : head_params(spec.decoder)) names.push_back(p.name);
  return names;
}

int expert_of(const std::string& name) {
  // Mixtral's "model.layers.0.block_sparse_moe.experts.3.w1.weight", Qwen3-MoE's
  // "model.layers.0.mlp.experts.3.gate_proj.weight".
  static const std::string key = ".experts.";
  const auto at = name.find(key);
  if (at == std::string::npos) return -1;
  const auto digits = at + key.size();
  if (digits >= name.size() || !std::isdigit(static_cast<unsigned char>(name[digits]))) return -1;
  return std::stoi(name.substr(digits));
}

bool expert_share::holds(const std::string& name, int n_experts) const {
  const int e = expert_of(name);
  if (e < 0 || !active()) return true;
  const int per = n_experts / size;
  return e >= rank * per && e < (rank + 1) * per;
}

std::string tied_parameter(const model_spec& spec) {
  if (spec.type != model_spec::kind::decoder || !spec.decoder.tie_embeddings) return "";
  return family_of(spec.decoder.arch).token_embedding;
}

std::int64_t parameter_count(const model_spec& spec) {
  std::int64_t n = 0;
  for (const auto& p : all_params(spec)) {
    std::int64_t k = 1;
    for (auto x : p.shape) k *= x;
    n += k;
  }
  return n;
}

state_dict initial_state(const model_spec& spec, std::uint64_t seed) {
  torch::NoGradGuard no_grad;
  auto gen = at::detail::createCPUGenerator(seed);
  state_dict out;
  for (const auto& p : all_params(spec)) {
    auto t = torch::empty(p.shape, torch::kFloat32);
    switch (p.how) {
      case param_spec::init::normal: t.normal_(0.0, p.stddev, gen); break;
      case param_spec::init::zeros: t.zero_(); break;
      case param_spec::init::ones: t.fill_(1.0); break;
      case param_spec::init::uniform_fan_in: {
        // fan_in is the weight's second dimension (a bias uses its layer's weight's).
        const auto& w = spec.mlp_widths;
        const int layer = std::stoi(p.name.substr(4)) / 2;
        const double bound = 1.0 / std::sqrt(double(w[layer]));
        t.uniform_(-bound, bound, gen);
        break;
      }
    }
    out.emplace_back(p.name, t);
  }
  return out;
}

void check_state(const model_spec& spec, const state_dict& state) {
  std::map<std::string, torch::Tensor> given(state.begin(), state.end());
  std::vector<std::string> problems;
  for (const auto& p : all_params(spec)) {
    auto it = given.find(p.name);
    if (it == given.end()) {
      problems.push_back("missing " + p.name);
      continue;
    }
    if (it->second.sizes() != c10::IntArrayRef(p.shape))
      problems.push_back(p.name + " has shape " + shape_str(it->second.sizes()) + ", expected " +
                         shape_str(p.shape));
    else if (!it->second.is_floating_point())
      problems.push_back(p.name + " is not a floating-point tensor");
    given.erase(it);
  }
  for (const auto& [name, t] : given) problems.push_back("unexpected " + name);
  if (!problems.empty()) {
    std::string msg = "state_dict does not fit model " + spec.name() + ": ";
    // Weights of another kind of architecture: say which, before the list of names.
    const bool llama_names = given.count("model.embed_tokens.weight") > 0, gpt_names = given.count("wte.weight") > 0;
    if (spec.type == model_spec::kind::decoder && !spec.is_llama() && llama_names)
      msg += "it holds a llama model's names (model.embed_tokens.weight): give --workload llama-tiny (or "
             "--architecture llama and its shape); ";
    else if (spec.is_llama() && gpt_names)
      msg += "it holds a gpt2 model's names (wte.weight): give --workload gpt-tiny (or --architecture gpt2 and its "
             "shape); ";
    for (std::size_t i = 0; i < problems.size() && i < 8; ++i) msg += (i ? "; " : "") + problems[i];
    if (problems.size() > 8) msg += "; and " + std::to_string(problems.size() - 8) + " more";
    throw model_error(msg);
  }
}

}  // namespace troupe
