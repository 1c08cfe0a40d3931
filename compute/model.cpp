#include "compute/model.hpp"

#include <algorithm>

#include <torch/version.h>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/autograd.h>
#include <torch/nn/functional.h>

#include "compute/device.hpp"
#include "compute/expert_parallel.hpp"
#include "compute/tensor_parallel.hpp"

#include <atomic>
#include <cmath>
#include <sstream>

namespace F = torch::nn::functional;

namespace troupe {

namespace {

std::atomic<std::int64_t> recomputed_blocks{0};
std::atomic<std::int64_t> recomputed_attentions{0};

/// A parameter of the full model: name, shape, how it is initialised, decayed or not.
struct param_spec {
  std::string name;
  std::vector<std::int64_t> shape;
  enum class init { normal, zeros, ones, uniform_fan_in } how;
  double stddev = 0;
  bool decay = false;
  tp_split split = tp_split::replicated;
};

std::vector<param_spec> gpt_block_params(const decoder_config& c, int i) {
  const std::string p = "h." + std::to_string(i) + ".";
  const std::int64_t d = c.d_model, f = c.d_ff;
  const double proj_std = 0.02 / std::sqrt(2.0 * c.n_layer);
  using I = param_spec::init;
  using S = tp_split;
  return {
      {p + "ln_1.weight", {d}, I::ones},
      {p + "ln_1.bias", {d}, I::zeros},
      {p + "attn.c_attn.weight", {3 * d, d}, I::normal, 0.02, true, S::qkv_rows},
      {p + "attn.c_attn.bias", {3 * d}, I::zeros, 0, false, S::qkv_rows},
      {p + "attn.c_proj.weight", {d, d}, I::normal, proj_std, true, S::columns},
      {p + "attn.c_proj.bias", {d}, I::zeros},
      {p + "ln_2.weight", {d}, I::ones},
      {p + "ln_2.bias", {d}, I::zeros},
      {p + "mlp.c_fc.weight", {f, d}, I::normal, 0.02, true, S::rows},
      {p + "mlp.c_fc.bias", {f}, I::zeros, 0, false, S::rows},
      {p + "mlp.c_proj.weight", {d, f}, I::normal, proj_std, true, S::columns},
      {p + "mlp.c_proj.bias", {d}, I::zeros},
  };
}

/// WORKLOADS.md "llama-tiny": Hugging Face's LlamaForCausalLM names, no biases.
std::vector<param_spec> llama_block_params(const decoder_config& c, int i) {
  const std::string p = "model.layers." + std::to_string(i) + ".";
  const std::int64_t d = c.d_model, f = c.d_ff, q = std::int64_t(c.n_head) * c.head_dim(),
                     kv = std::int64_t(c.kv_heads()) * c.head_dim();
  const double proj_std = 0.02 / std::sqrt(2.0 * c.n_layer);
  using I = param_spec::init;
  using S = tp_split;
  std::vector<param_spec> out{
      {p + "input_layernorm.weight", {d}, I::ones},
      {p + "self_attn.q_proj.weight", {q, d}, I::normal, 0.02, true, S::rows},
      {p + "self_attn.k_proj.weight", {kv, d}, I::normal, 0.02, true, S::rows},
      {p + "self_attn.v_proj.weight", {kv, d}, I::normal, 0.02, true, S::rows},
      {p + "self_attn.o_proj.weight", {d, q}, I::normal, proj_std, true, S::columns},
      {p + "post_attention_layernorm.weight", {d}, I::ones},
  };
  if (!c.is_moe_block(i)) {
    out.insert(out.end(), {{p + "mlp.gate_proj.weight", {f, d}, I::normal, 0.02, true, S::rows},
                           {p + "mlp.up_proj.weight", {f, d}, I::normal, 0.02, true, S::rows},
                           {p + "mlp.down_proj.weight", {d, f}, I::normal, proj_std, true, S::columns}});
    return out;
  }
  // WORKLOADS.md "moe-tiny": Mixtral's router and experts (w1: gate, w3: up, w2: down).
  const std::int64_t ef = c.expert_d_ff();
  out.push_back({p + "block_sparse_moe.gate.weight", {c.n_experts, d}, I::normal, 0.02, true});
  for (int e = 0; e < c.n_experts; ++e) {
    const std::string x = p + "block_sparse_moe.experts." + std::to_string(e) + ".";
    out.insert(out.end(), {{x + "w1.weight", {ef, d}, I::normal, 0.02, true},
                           {x + "w2.weight", {d, ef}, I::normal, proj_std, true},
                           {x + "w3.weight", {ef, d}, I::normal, 0.02, true}});
  }
  return out;
}

std::vector<param_spec> block_params(const decoder_config& c, int i) {
  return c.arch == decoder_arch::llama ? llama_block_params(c, i) : gpt_block_params(c, i);
}

std::vector<param_spec> embedding_params(const decoder_config& c) {
  using I = param_spec::init;
  if (c.arch == decoder_arch::llama)
    return {{"model.embed_tokens.weight", {c.vocab, c.d_model}, I::normal, 0.02, true, tp_split::rows}};
  return {{"wte.weight", {c.vocab, c.d_model}, I::normal, 0.02, true, tp_split::rows},
          {"wpe.weight", {c.seq_len, c.d_model}, I::normal, 0.02, false}};
}

/// The final norm, and the output layer when it is not the tied embedding.
std::vector<param_spec> head_params(const decoder_config& c) {
  using I = param_spec::init;
  std::vector<param_spec> out;
  if (c.arch == decoder_arch::llama) out = {{"model.norm.weight", {c.d_model}, I::ones}};
  else out = {{"ln_f.weight", {c.d_model}, I::ones}, {"ln_f.bias", {c.d_model}, I::zeros}};
  if (!c.tie_embeddings) out.push_back({"lm_head.weight", {c.vocab, c.d_model}, I::normal, 0.02, true, tp_split::rows});
  return out;
}

std::vector<param_spec> mlp_layer_params(const std::vector<int>& w, int i) {
  const std::string p = "net." + std::to_string(2 * i) + ".";
  using I = param_spec::init;
  // PyTorch's default Linear init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weight and bias.
  return {{p + "weight", {w[i + 1], w[i]}, I::uniform_fan_in, 0, false},
          {p + "bias", {w[i + 1]}, I::uniform_fan_in, 0, false}};
}

/// The full model's parameters in canonical (state_dict) order.
std::vector<param_spec> all_params(const model_spec& spec) {
  std::vector<param_spec> out;
  auto append = [&](std::vector<param_spec> v) { out.insert(out.end(), v.begin(), v.end()); };
  if (spec.type == model_spec::kind::decoder) {
    append(embedding_params(spec.decoder));
    for (int i = 0; i < spec.decoder.n_layer; ++i) append(block_params(spec.decoder, i));
    append(head_params(spec.decoder));
  } else {
    for (int i = 0; i < spec.n_layers(); ++i) append(mlp_layer_params(spec.mlp_widths, i));
  }
  return out;
}

/// The table's row of parameter `name` (a default one for an unknown name).
param_spec spec_of(const model_spec& spec, const std::string& name) {
  for (auto& p : all_params(spec))
    if (p.name == name) return p;
  return {};
}

std::string shape_str(c10::IntArrayRef s) {
  std::ostringstream o;
  o << s;
  return o.str();
}

}  // namespace

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
    for (const auto& p : block_params(spec.decoder, i)) names.push_back(p.name);
  if (range.last_slice)
    for (const auto& p : head_params(spec.decoder)) names.push_back(p.name);
  return names;
}

int expert_of(const std::string& name) {
  static const std::string key = ".block_sparse_moe.experts.";
  const auto at = name.find(key);
  if (at == std::string::npos) return -1;
  return std::stoi(name.substr(at + key.size()));
}

bool expert_share::holds(const std::string& name, int n_experts) const {
  const int e = expert_of(name);
  if (e < 0 || !active()) return true;
  const int per = n_experts / size;
  return e >= rank * per && e < (rank + 1) * per;
}

decoder_arch parse_decoder_arch(const std::string& name) {
  if (name == "gpt2") return decoder_arch::gpt2;
  if (name == "llama") return decoder_arch::llama;
  throw std::invalid_argument("unknown architecture '" + name + "' (expected gpt2 or llama)");
}

const char* decoder_arch_name(decoder_arch arch) { return arch == decoder_arch::llama ? "llama" : "gpt2"; }

std::string tied_parameter(const model_spec& spec) {
  if (spec.type != model_spec::kind::decoder || !spec.decoder.tie_embeddings) return "";
  return spec.is_llama() ? "model.embed_tokens.weight" : "wte.weight";
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
    // Weights of the other architecture: say which, before the list of names.
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

// --- split backward --------------------------------------------------------------------

void weight_grad_store::add(torch::Tensor weight, torch::Tensor input, torch::Tensor grad_output) {
  items_.push_back({std::move(weight), std::move(input), std::move(grad_output)});
}

void weight_grad_store::apply() {
  torch::NoGradGuard no_grad;
  for (auto& it : items_) {
    auto& grad = it.weight.mutable_grad();
    const auto dy = it.grad_output.reshape({-1, it.grad_output.size(-1)});
    const auto x = it.input.reshape({-1, it.input.size(-1)});
    grad.add_(dy.t().mm(x).to(grad.scalar_type()));
  }
  items_.clear();
}

namespace {

/// A linear layer whose backward computes the gradients of its input and bias and leaves
/// the weight's to a weight_grad_store. It computes in the precision autocast would (the
/// cast copies are what it keeps, as autocast's graph would).
struct deferred_linear : torch::autograd::Function<deferred_linear> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& w,
                               const torch::Tensor& b, weight_grad_store* store) {
    const auto dt = current_precision(x.device());
    const auto xc = x.to(dt), wc = w.to(dt);
    ctx->save_for_backward({xc, wc, w});
    ctx->saved_data["store"] = reinterpret_cast<std::int64_t>(store);
    ctx->saved_data["x_dtype"] = std::int64_t(x.scalar_type());
    ctx->saved_data["b_dtype"] = std::int64_t(b.scalar_type());
    return b.numel() > 0 ? torch::linear(xc, wc, b.to(dt)) : torch::linear(xc, wc);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto& dy = grads[0];
    if (!dy.defined()) return {torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
    const auto saved = ctx->get_saved_variables();
    auto dx = dy.matmul(saved[1]).to(torch::ScalarType(ctx->saved_data["x_dtype"].toInt()));
    const bool bias = ctx->needs_input_grad(2);
    auto db = bias ? dy.reshape({-1, dy.size(-1)}).sum(0).to(torch::ScalarType(ctx->saved_data["b_dtype"].toInt()))
                   : torch::Tensor();
    reinterpret_cast<weight_grad_store*>(ctx->saved_data["store"].toInt())->add(saved[2], saved[0], dy);
    return {dx, torch::Tensor(), db, torch::Tensor()};
  }
};

}  // namespace

// --- model_slice ---------------------------------------------------------------------

torch::Tensor model_slice::linear_layer(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b) {
  // (A custom function's inputs must be defined tensors: no bias is an empty one there.)
  if (defer_ && torch::GradMode::is_enabled())
    return deferred_linear::apply(x, w, b.defined() ? b : torch::empty({0}, w.options().requires_grad(false)), defer_);
  return torch::linear(x, w, b);
}

torch::Tensor& model_slice::param(const std::string& name) {
  auto it = index_.find(name);
  if (it == index_.end()) throw model_error("slice has no parameter " + name);
  return params_[it->second];
}

state_dict model_slice::state(bool include_shared_copies) const {
  state_dict out;
  for (std::size_t i = 0; i < entries_.size(); ++i)
    if (include_shared_copies || !entries_[i].shared_copy)
      out.emplace_back(entries_[i].name,
                       params_[i].detach().to(torch::kCPU, torch::kFloat32, /*non_blocking=*/false, /*copy=*/true));
  return out;
}

namespace {

/// Decoder parameters used outside matrix products (norms, embedding lookups), where
/// autocast computes in fp32: a bf16 slice keeps them as fp32 copies of its buffer's values.
bool computes_in_fp32(const std::string& name) {
  return name.find("ln_") != std::string::npos || name.find("norm.") != std::string::npos ||
         name == "wte.weight" || name == "wpe.weight" || name == "model.embed_tokens.weight";
}

}  // namespace

void model_slice::allocate(const model_spec& spec, const state_dict& state, std::vector<std::string> names,
                           const std::vector<std::string>& shared_copies, std::int64_t pad_to,
                           torch::Device device, torch::ScalarType param_dtype, const expert_share& experts) {
  if (param_dtype != torch::kFloat32 && param_dtype != torch::kBFloat16)
    throw model_error(std::string("parameters in ") + c10::toString(param_dtype) + ": expected fp32 or bf16");
  auto round_up = [](std::int64_t n, std::int64_t to) {
    to = std::max<std::int64_t>(to, 1);
    return (n + to - 1) / to * to;
  };
  // With an active share: the dense parameters, then this rank's experts.
  std::size_t first_expert = names.size();
  if (experts.active()) {
    const int E = spec.type == model_spec::kind::decoder ? spec.decoder.n_experts : 0;
    if (E % experts.size != 0)
      throw model_error(std::to_string(E) + " experts cannot be shared by " + std::to_string(experts.size) +
                        " expert-parallel ranks");
    std::vector<std::string> dense, own;
    for (auto& name : names)
      if (expert_of(name) < 0)
        dense.push_back(std::move(name));
      else if (experts.holds(name, E))
        own.push_back(std::move(name));
    first_expert = dense.size();
    names = std::move(dense);
    names.insert(names.end(), own.begin(), own.end());
  }
  std::map<std::string, torch::Tensor> given(state.begin(), state.end());
  entries_.clear();
  std::int64_t offset = 0;
  for (const auto& name : names) {
    if (entries_.size() == first_expert) offset = expert_offset_ = round_up(offset, pad_to);
    auto it = given.find(name);
    if (it == given.end()) throw model_error("state_dict has no parameter " + name);
    param_entry e;
    e.name = name;
    e.shape = it->second.sizes().vec();
    e.offset = offset;
    e.numel = it->second.numel();
    const auto row = spec_of(spec, name);
    e.decay = row.decay;
    e.split = row.split;
    e.shared_copy = std::find(shared_copies.begin(), shared_copies.end(), name) != shared_copies.end();
    offset += e.numel;
    entries_.push_back(e);
  }
  numel_ = 0;
  for (const auto& e : entries_) numel_ += e.numel;
  const bool has_experts = first_expert < names.size();
  const std::int64_t padded = has_experts ? expert_offset_ + round_up(offset - expert_offset_, experts.pad_to)
                                          : round_up(offset, pad_to);
  if (!has_experts) expert_offset_ = padded;
  torch::NoGradGuard no_grad;
  const auto opts = torch::TensorOptions().dtype(torch::kFloat32).device(device);
  flat_params_ = torch::zeros({padded}, opts.dtype(param_dtype));
  flat_grads_ = torch::zeros({padded}, opts);
  params_.clear();
  fp32_copies_.clear();
  for (std::size_t i = 0; i < entries_.size(); ++i) {
    const auto& e = entries_[i];
    auto view = flat_params_.narrow(0, e.offset, e.numel).view(e.shape);
    view.copy_(given.at(e.name));  // (rounded in a bf16 buffer)
    auto p = view;
    if (param_dtype != torch::kFloat32 && computes_in_fp32(e.name)) {
      p = view.to(torch::kFloat32, /*non_blocking=*/false, /*copy=*/true);
      fp32_copies_.push_back(i);
    }
    p.requires_grad_(true);
    // An fp32 view whatever the parameter's dtype: the autograd adds each gradient into it.
    p.mutable_grad() = flat_grads_.narrow(0, e.offset, e.numel).view(e.shape);
    params_.push_back(p);
    index_[e.name] = i;
  }
}

void model_slice::set_params(const torch::Tensor& src) {
  if (src.numel() != flat_params_.numel())
    throw model_error("parameters for a slice of " + std::to_string(flat_params_.numel()) + " elements: got " +
                      std::to_string(src.numel()));
  torch::NoGradGuard no_grad;
  flat_params_.copy_(src.reshape(flat_params_.sizes()));
  for (const auto i : fp32_copies_) {
    const auto& e = entries_[i];
    params_[i].copy_(flat_params_.narrow(0, e.offset, e.numel).view(e.shape));
  }
}

namespace {

// --- gpt-tiny --------------------------------------------------------------------------

class decoder_slice final : public model_slice {
 public:
  decoder_slice(const model_spec& spec, const layer_range& range, const state_dict& state, std::int64_t pad_to,
                torch::Device device, torch::ScalarType param_dtype, const tensor_parallel& tp,
                const expert_share& experts)
      : cfg_(spec.decoder), tp_(tp) {
    range_ = range;
    std::vector<std::string> shared;
    if (!range.first_slice && range.last_slice && !tied_parameter(spec).empty())
      shared.push_back(tied_parameter(spec));  // tied output layer: this stage's copy
    const auto names = slice_parameter_names(spec, range);
    if (!tp_.active()) {
      allocate(spec, state, names, shared, pad_to, device, param_dtype, experts);
    } else {
      check_tensor_parallel(spec, tp_.size, tp_.sequence);
      // (No group: a slice for the layout of the rank's part only, which computes nothing;
      // an optimizer shard's.)
      if (tp_.group && (tp_.group->size() != tp_.size || tp_.group->rank() != tp_.rank))
        throw model_error("tensor-parallel rank " + std::to_string(tp_.rank) + " of " + std::to_string(tp_.size) +
                          " with a group of rank " + std::to_string(tp_.group->rank()) + " of " +
                          std::to_string(tp_.group->size()));
      // This rank's part of each parameter, under the whole model's names.
      std::map<std::string, torch::Tensor> given(state.begin(), state.end());
      state_dict part;
      for (const auto& name : names) {
        if (!experts.holds(name, cfg_.n_experts)) continue;
        auto it = given.find(name);
        if (it == given.end()) throw model_error("state_dict has no parameter " + name);
        part.emplace_back(name, shard_parameter(spec, name, it->second, tp_.size, tp_.rank));
        // (Sharded experts are no copies: each rank's are its expert-data-parallel group's.)
        if (tp_.rank > 0 && tp_split_of(spec, name) == tp_split::replicated &&
            !(experts.active() && expert_of(name) >= 0))
          shared.push_back(name);
      }
      allocate(spec, part, names, shared, pad_to, device, param_dtype, experts);
      heads_ = cfg_.n_head / tp_.size;
      kv_heads_ = cfg_.kv_heads() / tp_.size;
      vocab_first_ = std::int64_t(cfg_.vocab / tp_.size) * tp_.rank;
    }
    causal_ = torch::ones({cfg_.seq_len, cfg_.seq_len}, torch::TensorOptions().dtype(torch::kBool).device(device)).tril();
    embedding_ = spec.is_llama() ? "model.embed_tokens.weight" : "wte.weight";
    output_ = cfg_.tie_embeddings ? embedding_ : "lm_head.weight";
    if (spec.is_llama()) {
      // Rotary tables as Hugging Face computes them, in fp32: inv_freq[j] = 1 / theta^(2j / hd),
      // angle = position * inv_freq[j]; cos and sin of [angles, angles] (length hd).
      const auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
      const std::int64_t hd = cfg_.head_dim();
      const auto inv_freq =
          torch::reciprocal(torch::pow(cfg_.rope_theta, torch::arange(0, hd, 2, f32.dtype(torch::kInt64)).to(torch::kFloat32) / hd));
      const auto angles = torch::arange(0, cfg_.seq_len, f32.dtype(torch::kInt64)).to(torch::kFloat32).unsqueeze(1) *
                          inv_freq.unsqueeze(0);
      const auto emb = torch::cat({angles, angles}, /*dim=*/1);
      rope_cos_ = emb.cos().to(device);
      rope_sin_ = emb.sin().to(device);
    }
  }

  torch::Tensor forward(const torch::Tensor& input) override {
    // Sequence parallelism: between the layers, this rank's positions only; a stage's
    // activations travel whole.
    torch::Tensor x = is_first() ? embed(input, 0, tp_.sequence) : sequence() ? tp::scatter_sequence(input, group()) : input;
    x = to_residual(x);
    const bool recompute = recompute_ == recompute_mode::full && torch::GradMode::is_enabled();
    // (Function::apply builds no backward node for an input without a gradient: the
    // blocks' parameters would get none.)
    if (recompute && !x.requires_grad()) x = x.detach().requires_grad_(true);
    for (int i = range_.first; i < range_.last; ++i)
      x = recompute ? recomputed_block::apply(x, this, std::int64_t(i)) : block(x, i);
    if (is_last()) x = final_norm(x);
    // (The last stage's enters its column-parallel output layer: each rank's share of the
    // gradient summed.)
    if (sequence()) x = tp::gather_sequence(x, group(), /*reduce_grad=*/is_last());
    return x;
  }

  torch::Tensor forward_cached(const torch::Tensor& input, kv_cache& cache) override {
    const std::int64_t from = cache.length, T = input.size(1);
    const std::size_t blocks = std::size_t(range_.last - range_.first);
    if (cache.keys.size() != blocks) {
      if (from != 0)
        throw model_error("the key/value cache holds " + std::to_string(cache.keys.size()) +
                          " blocks' keys; this slice has " + std::to_string(blocks) + " blocks");
      cache.keys.assign(blocks, {});
      cache.values.assign(blocks, {});
    }
    if (from > 0 && cache.keys.front().size(0) != input.size(0))
      throw model_error("the key/value cache holds " + std::to_string(cache.keys.front().size(0)) +
                        " sequences; the input has " + std::to_string(input.size(0)));
    if (from + T > cfg_.seq_len)
      throw model_error("positions " + std::to_string(from) + ".." + std::to_string(from + T - 1) +
                        " are past the model's context of " + std::to_string(cfg_.seq_len));
    torch::NoGradGuard no_grad;
    torch::Tensor x = to_residual(is_first() ? embed(input, from, /*sequence=*/false) : input);
    for (int i = range_.first; i < range_.last; ++i) x = block(x, i, &cache);
    cache.length = from + T;
    return is_last() ? final_norm(x) : x;
  }

  torch::Tensor logits(const torch::Tensor& output) override {
    auto l = own_logits(output);
    return tp_.active() ? tp::gather_dim(l, -1, group()) : l;
  }

  torch::Tensor loss(const torch::Tensor& output, const torch::Tensor& target) override {
    auto l = own_logits(output);
    if (tp_.active()) return tp::vocab_cross_entropy(l.to(torch::kFloat32), target, vocab_first_, group());
    return F::cross_entropy(l.view({-1, l.size(-1)}), target.reshape({-1}));
  }

 private:
  /// Block i with its activations recomputed in the backward (a reentrant checkpoint, as
  /// torch.utils.checkpoint's): the forward runs without a graph and keeps the block's
  /// input; the backward runs the block again with a graph, under the precision the
  /// forward ran in, and back-propagates through it (the parameters' gradients accumulate
  /// into the flat buffer as usual; the input's gradient is returned).
  struct recomputed_block : torch::autograd::Function<recomputed_block> {
    static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, decoder_slice* slice,
                                 std::int64_t i) {
      ctx->save_for_backward({x});
      ctx->saved_data["slice"] = reinterpret_cast<std::int64_t>(slice);
      ctx->saved_data["block"] = i;
      ctx->saved_data["precision"] = std::int64_t(current_precision(x.device()));
      ctx->saved_data["defer"] = reinterpret_cast<std::int64_t>(slice->defer_);
      slice->checkpointing_ = true;  // (no graph, but a training forward: its load-balancing loss counts)
      auto y = slice->block(x, int(i));
      slice->checkpointing_ = false;
      return y;
    }
    static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                   torch::autograd::variable_list grads) {
      if (!grads[0].defined()) return {torch::Tensor(), torch::Tensor(), torch::Tensor()};
      auto* slice = reinterpret_cast<decoder_slice*>(ctx->saved_data["slice"].toInt());
      const auto x = ctx->get_saved_variables()[0].detach().requires_grad_(true);
      torch::Tensor y;
      {
        torch::AutoGradMode grad(true);
        precision_scope amp(x.device(), torch::ScalarType(ctx->saved_data["precision"].toInt()));
        // The store the forward deferred into (the backward may run while another is set).
        auto* const before = slice->defer_;
        slice->defer_ = reinterpret_cast<weight_grad_store*>(ctx->saved_data["defer"].toInt());
        slice->recomputing_ = true;  // (its load-balancing loss was counted by the forward)
        y = slice->block(x, int(ctx->saved_data["block"].toInt()));
        slice->recomputing_ = false;
        slice->defer_ = before;
      }
      ++recomputed_blocks;
      torch::autograd::backward({y}, {grads[0]});
      return {x.grad(), torch::Tensor(), torch::Tensor()};
    }
  };

  /// The attention core, softmax(q k^T / sqrt(hd)) v, causal, for queries at positions
  /// past, past + 1, ... and keys from position 0 (q: (B, H, T, hd); k, v: (B, H, past + T, hd)).
  torch::Tensor attention(const torch::Tensor& q, torch::Tensor k, torch::Tensor v, std::int64_t past) const {
    const auto T = q.size(2), hd = q.size(3);
    if (k.size(1) != q.size(1)) {  // grouped-query: query head h uses key/value head h / (H / KV)
      const auto group = q.size(1) / k.size(1);
      k = k.repeat_interleave(group, /*dim=*/1);
      v = v.repeat_interleave(group, /*dim=*/1);
    }
    // Query t (position past + t) sees keys 0 .. past + t: rows past.. of the causal mask.
    // One new token sees them all: no mask.
    const bool masked = T > 1;
    const auto mask = causal_.slice(0, past, past + T).slice(1, 0, past + T);
#if TORCH_VERSION_MAJOR >= 2
    // LibTorch 2.x: the fused kernel (flash / memory-efficient attention on GPUs).
    (void)hd;
    return past == 0 ? at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true)
           : masked  ? at::scaled_dot_product_attention(q, k, v, mask)
                     : at::scaled_dot_product_attention(q, k, v);
#else
    auto att = torch::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(double(hd)));
    if (masked) att = att.masked_fill(mask.logical_not(), -std::numeric_limits<float>::infinity());
    att = torch::softmax(att, /*dim=*/-1);
    return torch::matmul(att, v);
#endif
  }

  /// The attention core with its activations recomputed in the backward (Megatron's
  /// selective recompute): the forward keeps q, k and v only; the backward runs the core
  /// again with a graph, under the precision the forward ran in, and returns the
  /// gradients of q, k and v.
  struct recomputed_attention : torch::autograd::Function<recomputed_attention> {
    static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                                 const torch::Tensor& v, const decoder_slice* slice) {
      ctx->save_for_backward({q, k, v});
      ctx->saved_data["slice"] = reinterpret_cast<std::int64_t>(slice);
      ctx->saved_data["precision"] = std::int64_t(current_precision(q.device()));
      return slice->attention(q, k, v, 0);
    }
    static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                   torch::autograd::variable_list grads) {
      if (!grads[0].defined()) return {torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
      const auto* slice = reinterpret_cast<const decoder_slice*>(ctx->saved_data["slice"].toInt());
      const auto saved = ctx->get_saved_variables();
      std::vector<torch::Tensor> in;
      for (const auto& t : saved) in.push_back(t.detach().requires_grad_(true));
      torch::Tensor y;
      {
        torch::AutoGradMode grad(true);
        precision_scope amp(in[0].device(), torch::ScalarType(ctx->saved_data["precision"].toInt()));
        y = slice->attention(in[0], in[1], in[2], 0);
      }
      ++recomputed_attentions;
      auto g = torch::autograd::grad({y}, in, {grads[0]});
      return {g[0], g[1], g[2], torch::Tensor()};
    }
  };

  /// The logits of this rank's vocabulary columns (all of them without tensor
  /// parallelism); the padded rows' are minus infinity.
  torch::Tensor own_logits(const torch::Tensor& output) {
    // Tensor parallelism: the output layer is column-parallel (f before it; with sequence
    // parallelism forward's gather is its f).
    auto l = torch::linear(tp_.active() && !tp_.sequence ? tp::copy_to(output, group()) : output, param(output_));
    if (cfg_.vocab_used > 0 && cfg_.vocab_used < cfg_.vocab) {  // padded rows: never a token
      if (!padded_.defined() || padded_.device() != l.device())
        padded_ = torch::arange(vocab_first_, vocab_first_ + l.size(-1), torch::TensorOptions().device(l.device())) >=
                  cfg_.vocab_used;
      l = l.masked_fill(padded_, -std::numeric_limits<float>::infinity());
    }
    return l;
  }

  /// Token (and gpt2's position) embeddings of `tokens` (batch, T) at positions from, from
  /// + 1, ... Tensor parallelism: vocab-parallel, summed over the group (with `sequence`,
  /// reduce-scattered: this rank's positions only).
  torch::Tensor embed(const torch::Tensor& tokens, std::int64_t from, bool sequence) {
    torch::Tensor x;
    if (!tp_.active()) {
      x = torch::embedding(param(embedding_), tokens);
    } else {
      x = tp::vocab_embedding(tokens, param(embedding_), vocab_first_);
      x = sequence ? tp::reduce_scatter_sequence(x, group()) : tp::reduce_from(x, group());
      if (sequence) from += x.size(1) * tp_.rank;
    }
    if (cfg_.arch == decoder_arch::llama) return x;  // positions enter through the rotary embedding
    auto pos = torch::arange(from, from + x.size(1), torch::TensorOptions().dtype(torch::kInt64).device(tokens.device()));
    return x + torch::embedding(param("wpe.weight"), pos);
  }

  bool sequence() const { return tp_.active() && tp_.sequence; }
  collective_group& group() const {
    if (!tp_.group) throw model_error("tensor-parallel rank " + std::to_string(tp_.rank) + " computes without a group");
    return *tp_.group;
  }
  /// Tensor parallelism, entering a column-parallel layer: f, or with sequence
  /// parallelism (`sequence`) the gather of the sequence.
  torch::Tensor enter(const torch::Tensor& x, bool sequence) {
    if (!tp_.active()) return x;
    return sequence ? tp::gather_sequence(x, group(), /*reduce_grad=*/true) : tp::copy_to(x, group());
  }
  /// A row-parallel layer (its bias, if any, added after the sum over the group: g, or with
  /// sequence parallelism the reduce-scatter of the sequence).
  torch::Tensor row_parallel(const torch::Tensor& x, const std::string& p, bool sequence) {
    const auto& bias = cfg_.arch == decoder_arch::gpt2 ? param(p + ".bias") : torch::Tensor();
    if (!tp_.active()) return linear_layer(x, param(p + ".weight"), bias);
    auto y = linear_layer(x, param(p + ".weight"), torch::Tensor());
    y = sequence ? tp::reduce_scatter_sequence(y, group()) : tp::reduce_from(y, group());
    return bias.defined() ? y + bias : y;
  }

  torch::Tensor final_norm(const torch::Tensor& x) {
    return cfg_.arch == decoder_arch::llama ? rms_norm(x, "model.norm") : layer_norm(x, "ln_f");
  }
  /// The residual stream in its dtype (see model_slice::set_residual_dtype): `x` rounded
  /// to bf16 under bf16 autocast when the slice keeps a bf16 stream, else `x`.
  torch::Tensor to_residual(const torch::Tensor& x) const {
    if (residual_ == torch::kFloat32 || x.scalar_type() == residual_ || !x.is_floating_point() ||
        current_precision(x.device()) != residual_)
      return x;
    return x.to(residual_);
  }
  torch::Tensor layer_norm(const torch::Tensor& x, const std::string& p) {
    const auto& w = param(p + ".weight");
    const auto& b = param(p + ".bias");
    if (x.scalar_type() == torch::kFloat32) return torch::layer_norm(x, {cfg_.d_model}, w, b, cfg_.norm_eps);
    // A bf16 residual stream: the norm in its dtype (the kernel's statistics in fp32),
    // not in autocast's fp32, with its weights as bf16 values.
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    return torch::layer_norm(x, {cfg_.d_model}, w.to(x.scalar_type()), b.to(x.scalar_type()), cfg_.norm_eps);
  }
  /// Llama's RMSNorm as Hugging Face computes it: the statistics in fp32, then the weight
  /// times the normalised input in the input's dtype.
  torch::Tensor rms_norm(const torch::Tensor& x, const std::string& p) {
    const auto xf = x.to(torch::kFloat32);
    const auto normed = xf * torch::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + cfg_.norm_eps);
    return param(p + ".weight").to(x.scalar_type()) * normed.to(x.scalar_type());
  }
  torch::Tensor linear(const torch::Tensor& x, const std::string& p) {
    return linear_layer(x, param(p + ".weight"), param(p + ".bias"));
  }
  torch::Tensor projection(const torch::Tensor& x, const std::string& p) {  // no bias
    return linear_layer(x, param(p + ".weight"), torch::Tensor());
  }
  /// The rotary embedding of q or k (B, heads, T, hd) at positions from, from + 1, ...
  /// (Hugging Face's rotate_half convention; the tables cast to x's dtype as it does).
  torch::Tensor rotate(const torch::Tensor& x, std::int64_t from) const {
    const auto T = x.size(2), half = x.size(3) / 2;
    const auto cos = rope_cos_.narrow(0, from, T).to(x.scalar_type());
    const auto sin = rope_sin_.narrow(0, from, T).to(x.scalar_type());
    const auto rotated = torch::cat({-x.narrow(3, half, half), x.narrow(3, 0, half)}, /*dim=*/3);
    return x * cos + rotated * sin;
  }

  /// Appends k and v (B, KV, T, hd) to block i's cache and returns all its keys and values
  /// so far. `past`: the tokens the cache holds.
  std::pair<torch::Tensor, torch::Tensor> cached(kv_cache& cache, int i, std::int64_t past, const torch::Tensor& k,
                                                 const torch::Tensor& v) const {
    const std::size_t j = std::size_t(i - range_.first);
    const auto B = k.size(0), KV = k.size(1), T = k.size(2), hd = k.size(3);
    auto& keys = cache.keys[j];
    auto& values = cache.values[j];
    if (past == 0) {  // (a cache that starts again keeps its buffers when they fit)
      const std::vector<std::int64_t> shape{B, KV, cfg_.seq_len, hd};
      if (!keys.defined() || keys.sizes() != c10::IntArrayRef(shape) || keys.scalar_type() != k.scalar_type() ||
          keys.device() != k.device()) {
        keys = torch::empty(shape, k.options());
        values = torch::empty(shape, v.options());
      }
    }
    keys.narrow(2, past, T).copy_(k);
    values.narrow(2, past, T).copy_(v);
    return {keys.narrow(2, 0, past + T), values.narrow(2, 0, past + T)};
  }

  /// The attention core for q (B, H, T, hd), k and v (B, KV, T, hd), with or without a
  /// cache, with selective recompute when it applies; returns (B, T, H * hd).
  torch::Tensor attend(torch::Tensor q, torch::Tensor k, torch::Tensor v, int i, kv_cache* cache) {
    std::int64_t past = 0;
    if (cache) {
      past = cache->length;
      std::tie(k, v) = cached(*cache, i, past, k, v);
    }
    const bool selective = recompute_ == recompute_mode::selective && !cache && torch::GradMode::is_enabled();
    auto y = selective ? recomputed_attention::apply(q, k, v, this) : attention(q, k, v, past);
    const auto B = q.size(0), T = q.size(2);
    return y.transpose(1, 2).contiguous().view({B, T, q.size(1) * q.size(3)});
  }

  /// Block i. With a cache, `x` holds the tokens after the cache's: their keys and values
  /// are appended to the block's, and they attend to all of them.
  torch::Tensor block(torch::Tensor x, int i, kv_cache* cache = nullptr) {
    return cfg_.arch == decoder_arch::llama ? llama_block(std::move(x), i, cache) : gpt_block(std::move(x), i, cache);
  }

  torch::Tensor gpt_block(torch::Tensor x, int i, kv_cache* cache) {
    const std::string p = "h." + std::to_string(i) + ".";
    const bool seq = sequence() && !cache;
    const std::int64_t H = heads_, hd = cfg_.head_dim();
    // attention: fused qkv, causal softmax(q k^T / sqrt(hd)) v, output projection
    const auto a = enter(layer_norm(x, p + "ln_1"), seq);
    const auto B = a.size(0), T = a.size(1);
    auto qkv = linear(a, p + "attn.c_attn").split(H * hd, /*dim=*/2);
    auto q = qkv[0].view({B, T, H, hd}).transpose(1, 2);
    auto k = qkv[1].view({B, T, H, hd}).transpose(1, 2);
    auto v = qkv[2].view({B, T, H, hd}).transpose(1, 2);
    x = x + row_parallel(attend(q, k, v, i, cache), p + "attn.c_proj", seq);
    // mlp: c_fc, exact GELU, c_proj
    auto h = torch::gelu(linear(enter(layer_norm(x, p + "ln_2"), seq), p + "mlp.c_fc"));
    return x + row_parallel(h, p + "mlp.c_proj", seq);
  }

  /// WORKLOADS.md "llama-tiny": h = x + o_proj(attn(input_layernorm(x))), then
  /// h + down_proj(silu(gate_proj(g)) * up_proj(g)) with g = post_attention_layernorm(h).
  torch::Tensor llama_block(torch::Tensor x, int i, kv_cache* cache) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    const bool seq = sequence() && !cache;
    const std::int64_t H = heads_, KV = kv_heads_, hd = cfg_.head_dim();
    const std::int64_t from = cache ? cache->length : 0;
    const auto a = enter(rms_norm(x, p + "input_layernorm"), seq);
    const auto B = a.size(0), T = a.size(1);
    auto q = rotate(projection(a, p + "self_attn.q_proj").view({B, T, H, hd}).transpose(1, 2), from);
    auto k = rotate(projection(a, p + "self_attn.k_proj").view({B, T, KV, hd}).transpose(1, 2), from);
    auto v = projection(a, p + "self_attn.v_proj").view({B, T, KV, hd}).transpose(1, 2);
    x = x + row_parallel(attend(q, k, v, i, cache), p + "self_attn.o_proj", seq);
    if (cfg_.is_moe_block(i)) {
      // The experts compute on this rank's tokens, not split (expert tensor parallelism 1):
      // under sequence parallelism its part of the sequences, so nothing is gathered.
      return x + experts(rms_norm(x, p + "post_attention_layernorm"), i).to(x.scalar_type());
    }
    const auto g = enter(rms_norm(x, p + "post_attention_layernorm"), seq);
    const auto h = torch::silu(projection(g, p + "mlp.gate_proj")) * projection(g, p + "mlp.up_proj");
    return x + row_parallel(h, p + "mlp.down_proj", seq);
  }

  /// The gradient of the load-balancing loss, entering where the block's output leaves:
  /// identity forward; backward, the output's gradient and `scale` for the loss.
  struct add_aux_loss : torch::autograd::Function<add_aux_loss> {
    static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& y,
                                 const torch::Tensor& aux, double scale) {
      ctx->saved_data["scale"] = scale;
      ctx->saved_data["aux_dtype"] = std::int64_t(aux.scalar_type());
      return y;
    }
    static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                   torch::autograd::variable_list grads) {
      const auto dtype = torch::ScalarType(ctx->saved_data["aux_dtype"].toInt());
      const auto d_aux = torch::full({}, ctx->saved_data["scale"].toDouble(), grads[0].options().dtype(dtype));
      return {grads[0], d_aux, torch::Tensor()};
    }
  };

  /// WORKLOADS.md "moe-tiny": Mixtral's sparse MLP on g (B, T, d). Per token the router's
  /// softmax in fp32 over every expert; the top_k largest (ties: the lower index, a stable
  /// sort) with weights renormalised to sum 1; no token dropped unless a capacity factor
  /// is set (then in training only: drop_past_capacity). With a graph, the per-sequence
  /// load-balancing loss joins the backward (add_aux_loss).
  torch::Tensor experts(const torch::Tensor& g, int layer) {
    const std::string p = "model.layers." + std::to_string(layer) + ".block_sparse_moe.";
    const auto B = g.size(0), T = g.size(1), d = g.size(2);
    const std::int64_t E = cfg_.n_experts, k = cfg_.moe_top_k;
    const auto x = g.reshape({B * T, d});
    const auto probs = torch::softmax(projection(x, p + "gate").to(torch::kFloat32), -1);  // (N, E)
    const auto chosen = std::get<1>(torch::sort(probs.detach(), /*stable=*/true, /*dim=*/-1, /*descending=*/true))
                            .narrow(1, 0, k);  // (N, k)
    const auto picked = probs.gather(1, chosen);
    const auto weights = picked / picked.sum(1, /*keepdim=*/true);  // (N, k), fp32
    // A training forward (with a graph, or a full recompute's forward without one and its
    // rerun in the backward) drops what exceeds the experts' capacity; a dropped pair's
    // expert is E, no expert's.
    const bool graph = torch::GradMode::is_enabled(), training = graph || checkpointing_ || recomputing_;
    const auto routed = training && cfg_.moe_capacity_factor > 0 ? within_capacity(probs.detach(), chosen, B) : chosen;
    torch::Tensor out = ep_.active() ? parallel_experts(x, routed, weights, p) : local_experts(x, routed, weights, p);
    out = out.view({B, T, d});
    // A training forward counts its load-balancing loss once (not when a full recompute
    // runs the block again) and back-propagates it where a graph is built.
    const bool counts_aux = !recomputing_ && (graph || checkpointing_);
    if (counts_aux) {  // the pairs per expert, then those dropped (metrics), once per training forward
      const auto n = torch::bincount(routed.reshape({-1}), /*weights=*/{}, E + 1);
      auto& sum = expert_tokens_[layer];
      sum = sum.defined() ? sum + n : n;
    }
    if ((!graph && !counts_aux) || cfg_.moe_aux_coeff == 0) return out;
    // Per sequence: f_e = its tokens' choices of e / (k T), P_e = the mean of p_e over its
    // tokens; aux = coeff E sum_e f_e P_e, the mean over the micro-batch's sequences. Under
    // sequence parallelism each rank holds T / size tokens of every sequence: the sums are
    // all-reduced over the group (identity backward, so each rank's gradient reaches its
    // own tokens' probabilities; the router's are summed over the group as the norms').
    const auto counts = torch::zeros({B * T, E}, probs.options()).scatter_add_(1, chosen, torch::ones_like(picked.detach()));
    auto f = counts.view({B, T, E}).sum(1);
    auto P = probs.view({B, T, E}).sum(1);
    std::int64_t seq_len = T;
    if (sequence()) {
      f = tp::reduce_from(f, group());
      P = tp::reduce_from(P, group());
      seq_len *= tp_.size;
    }
    f = f / double(k * seq_len);
    P = P / double(seq_len);
    const auto aux = (f * P).sum(1).mean() * (cfg_.moe_aux_coeff * double(E));
    if (counts_aux) {
      const auto counted = aux.detach() * aux_scale_;
      aux_sum_ = aux_sum_.defined() ? aux_sum_ + counted : counted;
    }
    return graph ? add_aux_loss::apply(out, aux, aux_scale_) : out;
  }

  /// `chosen` (B T, k) less the pairs past their experts' capacity in each sequence
  /// (drop_past_capacity). Under sequence parallelism this rank holds T of each sequence's
  /// T x size tokens: the router's probabilities of the whole sequences are gathered over
  /// the group (no gradient), every rank decides for the whole sequences, the same way
  /// (the stable sorts of the same values), and keeps its own positions.
  torch::Tensor within_capacity(const torch::Tensor& probs, const torch::Tensor& chosen, std::int64_t B) {
    const std::int64_t T = chosen.size(0) / B;
    if (!sequence()) return drop_past_capacity(probs, chosen, B, cfg_.expert_capacity(T));
    const std::int64_t E = probs.size(1), k = chosen.size(1), whole = T * tp_.size;
    const auto all = tp::gather_dim(probs.view({B, T, E}), 1, group()).reshape({B * whole, E});
    const auto all_chosen =
        std::get<1>(torch::sort(all, /*stable=*/true, /*dim=*/-1, /*descending=*/true)).narrow(1, 0, k);
    const auto kept = drop_past_capacity(all, all_chosen, B, cfg_.expert_capacity(whole));
    return kept.view({B, whole, k}).narrow(1, T * tp_.rank, T).reshape({B * T, k});
  }

  /// The capacity factor (Megatron's token dropping, drop policy "probs", per sequence so
  /// that no layout changes it): of each sequence's (token, choice) pairs routed to an
  /// expert, the `capacity` with the highest router probability stay (ties: the earlier
  /// token); the others get expert E (none). `chosen` (B T, k); returns the same shape.
  torch::Tensor drop_past_capacity(const torch::Tensor& probs, const torch::Tensor& chosen, std::int64_t B,
                                   std::int64_t capacity) {
    const std::int64_t E = cfg_.n_experts, N = chosen.size(0), T = N / B;
    const auto picked = torch::zeros({N, E}, chosen.options().dtype(torch::kBool))
                            .scatter_(1, chosen, true);  // (N, E): routed pairs
    const auto score = torch::where(picked, probs, torch::full({}, -1.0f, probs.options())).view({B, T, E});
    const auto order = std::get<1>(torch::sort(score, /*stable=*/true, /*dim=*/1, /*descending=*/true));
    // Each pair's place among its sequence's pairs of the same expert (0: the most probable).
    const auto place = torch::empty_like(order).scatter_(
        1, order, torch::arange(T, order.options()).view({1, T, 1}).expand({B, T, E}));
    const auto kept = (picked & place.view({N, E}).lt(capacity)).gather(1, chosen);  // (N, k)
    return torch::where(kept, chosen, torch::full({}, E, chosen.options()));
  }

  /// Expert e of the layer named `p`: w2(silu(w1(x)) * w3(x)).
  torch::Tensor expert(const torch::Tensor& x, const std::string& p, std::int64_t e) {
    const std::string w = p + "experts." + std::to_string(e) + ".";
    return projection(torch::silu(projection(x, w + "w1")) * projection(x, w + "w3"), w + "w2");
  }

  /// Every expert here, each on the tokens that chose it, summed into the tokens' rows in
  /// expert order.
  torch::Tensor local_experts(const torch::Tensor& x, const torch::Tensor& chosen, const torch::Tensor& weights,
                              const std::string& p) {
    torch::Tensor out = torch::zeros_like(x);
    for (std::int64_t e = 0; e < cfg_.n_experts; ++e) {
      const auto hit = chosen.eq(e);  // (N, k)
      const auto rows = hit.any(1).nonzero().squeeze(1);
      if (rows.numel() == 0) continue;  // no token for this expert: no gradient either
      const auto ye = expert(x.index_select(0, rows), p, e);
      const auto we = (weights * hit.to(weights.scalar_type())).sum(1).index_select(0, rows);
      // (Summed in the block's activation dtype, as Hugging Face's Mixtral does: under bf16
      // autocast the experts compute in bf16, their weighted outputs add up in fp32.)
      out = out.index_add(0, rows, (ye * we.unsqueeze(1).to(ye.scalar_type())).to(out.scalar_type()));
    }
    return out;
  }

  /// Expert parallelism (compute/expert_parallel.hpp): this rank's tokens' (token, choice)
  /// pairs go to their experts' ranks, this rank's experts run on what came, the results
  /// go back; each token sums its choices in expert order, as the loop above does.
  torch::Tensor parallel_experts(const torch::Tensor& x, const torch::Tensor& chosen, const torch::Tensor& weights,
                                 const std::string& p) {
    // A forward recomputed inside a backward calls the backwards' group (the order of
    // each group's calls is the same on every rank).
    auto& g = recomputing_ ? ep_.backward() : *ep_.group;
    const std::int64_t k = chosen.size(1), local = cfg_.n_experts / g.size(), first = local * g.rank();
    const auto plan = ep::plan_dispatch(chosen, cfg_.n_experts, g);
    const auto token = plan.order.div(k, "floor").to(x.device());  // each sorted pair's token
    const auto received = ep::all_to_all(x.index_select(0, token), g, ep_.backward(), plan.send_rows, plan.recv_rows);
    // Every received row is some local expert's, so each is overwritten below; starting
    // from the rows times 0 keeps both all-to-alls in the graph on every rank, also on one
    // whose experts got no row (its backward must still take part in theirs).
    torch::Tensor results = received.mul(0);
    for (std::int64_t j = 0; j < local; ++j) {
      const auto rows = plan.rows_of_expert[std::size_t(j)].to(x.device());
      if (rows.numel() == 0) continue;  // no token for this expert: no gradient either
      const auto ye = expert(received.index_select(0, rows), p, first + j);
      results = results.index_copy(0, rows, ye.to(results.scalar_type()));
    }
    const auto back = ep::all_to_all(results, g, ep_.backward(), plan.recv_rows, plan.send_rows);  // sorted pairs' order
    const auto we = weights.reshape({-1}).index_select(0, plan.order.to(x.device()));
    return torch::zeros_like(x).index_add(0, token, back * we.unsqueeze(1).to(back.scalar_type()));
  }

  decoder_config cfg_;
  tensor_parallel tp_;
  bool recomputing_ = false;   ///< a block runs again in its backward (full recompute)
  bool checkpointing_ = false; ///< a block runs without a graph in a full recompute's forward
  std::int64_t heads_ = cfg_.n_head, kv_heads_ = cfg_.kv_heads();  ///< this rank's
  std::int64_t vocab_first_ = 0;  ///< this rank's first vocabulary row (tensor parallelism)
  torch::Tensor causal_;
  torch::Tensor rope_cos_, rope_sin_;  ///< llama: (seq_len, head dim), fp32
  std::string embedding_, output_;     ///< the token embedding's and the output layer's names
  torch::Tensor padded_;               ///< (vocab) bool: the rows past the tokenizer's pieces
};

// --- fmnist-mlp ------------------------------------------------------------------------

class mlp_slice final : public model_slice {
 public:
  mlp_slice(const model_spec& spec, const layer_range& range, const state_dict& state,
            std::int64_t pad_to, torch::Device device, torch::ScalarType param_dtype)
      : n_layers_(spec.n_layers()) {
    range_ = range;
    allocate(spec, state, slice_parameter_names(spec, range), {}, pad_to, device, param_dtype, {});
  }

  torch::Tensor forward(const torch::Tensor& input) override {
    torch::Tensor x = input;
    for (int i = range_.first; i < range_.last; ++i) {
      const std::string p = "net." + std::to_string(2 * i) + ".";
      x = linear_layer(x, param(p + "weight"), param(p + "bias"));
      if (i + 1 < n_layers_) x = torch::relu(x);
    }
    return x;
  }
  torch::Tensor logits(const torch::Tensor& output) override { return output; }
  torch::Tensor loss(const torch::Tensor& output, const torch::Tensor& target) override {
    return F::cross_entropy(output, target);
  }

 private:
  int n_layers_;
};

}  // namespace

std::int64_t model_slice::blocks_recomputed() { return recomputed_blocks.load(); }

expert_counts model_slice::take_expert_tokens() {
  expert_counts out;
  for (auto& [layer, t] : expert_tokens_) {
    const auto c = t.to(torch::kCPU, torch::kInt64).contiguous();
    out[layer].assign(c.data_ptr<std::int64_t>(), c.data_ptr<std::int64_t>() + c.numel());
  }
  expert_tokens_.clear();
  return out;
}

void add_expert_counts(expert_counts& into, const expert_counts& from) {
  for (const auto& [layer, counts] : from) {
    auto& sum = into[layer];
    sum.resize(std::max(sum.size(), counts.size()), 0);
    for (std::size_t e = 0; e < counts.size(); ++e) sum[e] += counts[e];
  }
}

double model_slice::take_aux_loss() {
  if (!aux_sum_.defined()) return 0;
  const double v = aux_sum_.item<double>();
  aux_sum_ = torch::Tensor();
  return v;
}
std::int64_t model_slice::attentions_recomputed() { return recomputed_attentions.load(); }

recompute_mode parse_recompute(const std::string& name) {
  if (name == "none") return recompute_mode::none;
  if (name == "selective") return recompute_mode::selective;
  if (name == "full") return recompute_mode::full;
  throw std::invalid_argument("unknown recompute '" + name + "' (expected none, selective or full)");
}

torch::Tensor model_slice::forward_cached(const torch::Tensor&, kv_cache&) {
  throw model_error("this model has no attention: no key/value cache");
}

std::unique_ptr<model_slice> make_slice(const model_spec& spec, const layer_range& range,
                                        const state_dict& state, std::int64_t pad_to, torch::Device device,
                                        torch::ScalarType param_dtype, const tensor_parallel& tp,
                                        const expert_share& experts) {
  if (range.first < 0 || range.last > spec.n_layers() || range.first >= range.last)
    throw model_error("layer range [" + std::to_string(range.first) + ", " +
                      std::to_string(range.last) + ") does not fit " + spec.name() + " with " +
                      std::to_string(spec.n_layers()) + " layers");
  if (spec.type == model_spec::kind::decoder)
    return std::make_unique<decoder_slice>(spec, range, state, pad_to, device, param_dtype, tp, experts);
  check_tensor_parallel(spec, tp.size, tp.sequence);  // (refuses a split of the MLP)
  if (experts.active()) throw model_error(spec.name() + " has no experts to share over expert-parallel ranks");
  return std::make_unique<mlp_slice>(spec, range, state, pad_to, device, param_dtype);
}

}  // namespace troupe
