#include "compute/models/model_slice.hpp"

#include <algorithm>
#include <map>

#include <torch/torch.h>

#include "compute/models/recompute.hpp"

namespace troupe {

torch::Tensor model_slice::linear_layer(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b) {
  return linear(x, w, b, defer_);
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
                           torch::Device device, torch::ScalarType param_dtype, const expert_share& experts,
                           const std::map<std::string, param_spec>* rows_given, const std::string& block_prefix) {
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
  const auto rows = rows_given ? *rows_given : rows_by_name(spec);
  entries_.clear();
  entry_blocks_.clear();
  segments_.clear();
  std::int64_t offset = 0;
  for (const auto& name : names) {
    if (entries_.size() == first_expert) offset = expert_offset_ = round_up(offset, pad_to);
    int block = -1;
    if (!block_prefix.empty() && name.compare(0, block_prefix.size(), block_prefix) == 0)
      block = std::stoi(name.substr(block_prefix.size()));
    // A block begins at a multiple of its region's padding (a unit of FSDP by blocks).
    if (!entry_blocks_.empty() && block != entry_blocks_.back()) {
      const bool experts_region = entries_.size() >= first_expert;
      const std::int64_t base = experts_region ? expert_offset_ : 0;
      offset = base + round_up(offset - base, experts_region ? experts.pad_to : pad_to);
    }
    entry_blocks_.push_back(block);
    auto it = given.find(name);
    if (it == given.end()) throw model_error("state_dict has no parameter " + name);
    param_entry e;
    e.name = name;
    e.shape = it->second.sizes().vec();
    e.offset = offset;
    e.numel = it->second.numel();
    const auto found = rows.find(name);
    const auto row = found == rows.end() ? param_spec{} : found->second;
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
  sources_.clear();
  fp32_copies_.clear();
  for (std::size_t i = 0; i < entries_.size(); ++i) {
    const auto& e = entries_[i];
    auto view = flat_params_.narrow(0, e.offset, e.numel).view(e.shape);
    // (Rounded in a bf16 buffer. A meta tensor gives the shape only: the caller sets the
    // values, as an actor rebuilt from snapshots does.)
    if (!given.at(e.name).is_meta()) view.copy_(given.at(e.name));
    auto p = view;
    sources_.push_back(view);
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
  if (segments_.empty()) {
    flat_params_.copy_(src.reshape(flat_params_.sizes()));
  } else {
    const auto flat = src.reshape({-1});
    for (auto& [range, view] : segments_) view.copy_(flat.narrow(0, range.first, range.second - range.first));
  }
  refresh_copies();
}

void model_slice::refresh_copies(std::int64_t begin, std::int64_t end) {
  torch::NoGradGuard no_grad;
  for (const auto i : fp32_copies_) {
    const auto& e = entries_[i];
    if (e.offset >= begin && e.offset < end) params_[i].copy_(sources_[i]);
  }
}

std::vector<model_slice::unit_buffers> model_slice::split_buffers(
    const std::vector<std::vector<std::pair<std::int64_t, std::int64_t>>>& units) {
  torch::NoGradGuard no_grad;
  std::vector<unit_buffers> out;
  std::vector<char> placed(entries_.size(), 0);
  std::vector<bool> copy(entries_.size(), false);
  for (const auto i : fp32_copies_) copy[i] = true;
  segments_.clear();
  for (const auto& ranges : units) {
    std::int64_t n = 0;
    for (const auto& r : ranges) n += r.second - r.first;
    unit_buffers u{torch::empty({n}, flat_params_.options()), torch::zeros({n}, flat_grads_.options())};
    std::int64_t at = 0;
    for (const auto& [begin, end] : ranges) {
      u.params.narrow(0, at, end - begin).copy_(flat_params_.narrow(0, begin, end - begin));
      segments_.push_back({{begin, end}, u.params.narrow(0, at, end - begin)});
      for (std::size_t i = 0; i < entries_.size(); ++i) {
        const auto& e = entries_[i];
        if (e.offset < begin || e.offset >= end) continue;
        if (e.offset + e.numel > end)
          throw model_error("FSDP units: parameter " + e.name + " crosses the end of a unit's range");
        const auto local = at + e.offset - begin;
        auto view = u.params.narrow(0, local, e.numel).view(e.shape);
        sources_[i] = view;
        if (!copy[i]) {
          view.requires_grad_(true);
          params_[i] = view;
        }
        params_[i].mutable_grad() = u.grads.narrow(0, local, e.numel).view(e.shape);
        placed[i] = 1;
      }
      at += end - begin;
    }
    out.push_back(std::move(u));
  }
  for (std::size_t i = 0; i < entries_.size(); ++i)
    if (!placed[i]) throw model_error("FSDP units: parameter " + entries_[i].name + " is in no unit");
  return out;
}

void model_slice::refresh_copies() {
  torch::NoGradGuard no_grad;
  for (const auto i : fp32_copies_) params_[i].copy_(sources_[i]);
}

std::int64_t model_slice::blocks_recomputed() { return troupe::blocks_recomputed(); }
std::int64_t model_slice::attentions_recomputed() { return troupe::attentions_recomputed(); }

expert_counts model_slice::take_expert_tokens() {
  expert_counts out;
  for (auto& [layer, t] : expert_tokens_) {
    const auto c = t.to(torch::kCPU, torch::kInt64).contiguous();
    out[layer].assign(c.data_ptr<std::int64_t>(), c.data_ptr<std::int64_t>() + c.numel());
  }
  expert_tokens_.clear();
  return out;
}

void model_slice::set_context_parallel(context_parallel cp) {
  if (cp.active()) throw model_error("context parallelism splits a decoder's sequences; this model has none");
  cp_ = std::move(cp);
}

double model_slice::take_aux_loss() {
  if (!aux_sum_.defined()) return 0;
  const double v = aux_sum_.item<double>();
  aux_sum_ = torch::Tensor();
  return v;
}

torch::Tensor model_slice::forward_cached(const torch::Tensor&, kv_cache&) {
  throw model_error("this model has no attention: no key/value cache");
}

}  // namespace troupe
