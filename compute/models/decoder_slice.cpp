#include "compute/models/decoder_slice.hpp"

#include <limits>
#include <map>
#include <vector>

#include <torch/nn/functional.h>
#include <torch/torch.h>

#include "compute/models/block.hpp"
#include "compute/models/parts/norm.hpp"
#include "compute/models/tensor_parallel_layout.hpp"
#include "compute/parallel/tensor_parallel.hpp"
#include "compute/runtime/device.hpp"

namespace F = torch::nn::functional;

namespace troupe {

decoder_slice::decoder_slice(const model_spec& spec, const layer_range& range, const state_dict& state,
                             std::int64_t pad_to, torch::Device device, torch::ScalarType param_dtype,
                             const tensor_parallel& tp, const expert_share& experts)
    : cfg_(spec.decoder), family_(family_of(spec.decoder.arch)), tp_(tp) {
  range_ = range;
  std::vector<std::string> shared;
  if (!range.first_slice && range.last_slice && !tied_parameter(spec).empty())
    shared.push_back(tied_parameter(spec));  // tied output layer: this stage's copy
  const auto names = slice_parameter_names(spec, range);
  if (!tp_.active()) {
    allocate(spec, state, names, shared, pad_to, device, param_dtype, experts, nullptr, family_.block_prefix);
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
    const auto rows = rows_by_name(spec, tp_.size);
    state_dict part;
    for (const auto& name : names) {
      if (!experts.holds(name, cfg_.n_experts)) continue;
      auto it = given.find(name);
      if (it == given.end()) throw model_error("state_dict has no parameter " + name);
      const auto row = rows.find(name);
      const auto split = row == rows.end() ? param_spec{}.split : row->second.split;
      part.emplace_back(name, shard_parameter(split, it->second, tp_.size, tp_.rank));
      // (Sharded experts are no copies: each rank's are its expert-data-parallel group's.)
      if (tp_.rank > 0 && split == tp_split::replicated && !(experts.active() && expert_of(name) >= 0))
        shared.push_back(name);
    }
    allocate(spec, part, names, shared, pad_to, device, param_dtype, experts, &rows, family_.block_prefix);
    heads_ = cfg_.n_head / tp_.size;
    kv_heads_ = std::max(1, cfg_.kv_heads() / tp_.size);  // (fewer than the ranks: one, replicated)
    vocab_first_ = std::int64_t(cfg_.vocab / tp_.size) * tp_.rank;
  }
  window_ = family_.attention.sliding_window ? cfg_.sliding_window : 0;
  core_ = std::make_unique<causal_attention>(cfg_.seq_len, device, window_);
  embedding_ = family_.token_embedding;
  output_ = cfg_.tie_embeddings ? embedding_ : family_.output;
  if (family_.positions == position_kind::rotary) rotary_.emplace(cfg_, device);
}

torch::Tensor decoder_slice::forward(const torch::Tensor& input, const torch::Tensor& positions) {
  // Documents: every block of this forward attends by their mask (the positions whole
  // under sequence parallelism: the attention gathers the sequence).
  window_documents docs;
  if (positions.defined()) {
    if (positions.dim() != 2 || positions.size(0) != input.size(0) || positions.size(1) != cfg_.seq_len)
      throw model_error("document positions of shape " + c10::str(positions.sizes()) + " for " +
                        std::to_string(input.size(0)) + " sequences of " + std::to_string(cfg_.seq_len) + " tokens");
    const auto p = positions.to(input.device(), torch::kInt64);
    if (cp_.active())
      docs = {cp::local_tokens(p, 1, cp_.size, cp_.rank), {}, cp::document_numbers(p)};
    else
      docs = {p, core_->document_mask(p)};
  }
  // Context parallelism: this rank's tokens of whole sequences at the first slice, and
  // their global positions (the rotary or learned positions'; with documents, the
  // document positions of this rank's tokens). The attention's core is the group's: it
  // masks by global position, and by the documents' numbers.
  auto tokens = input;
  if (cp_.active()) {
    if (is_first()) tokens = cp::local_tokens(input, 1, cp_.size, cp_.rank);
    if (!positions.defined())
      docs.positions = cp::local_positions(cfg_.seq_len, cp_.size, cp_.rank, input.device())
                           .unsqueeze(0)
                           .expand({input.size(0), cfg_.seq_len / cp_.size})
                           .contiguous();
  }
  // Sequence parallelism: between the layers, this rank's positions only; a stage's
  // activations travel whole.
  torch::Tensor x = is_first() ? embed(tokens, 0, tp_.sequence, docs.positions)
                    : sequence() ? tp::scatter_sequence(input, group())
                                 : input;
  x = to_residual(x);
  const bool recompute = recompute_ == recompute_mode::full && torch::GradMode::is_enabled();
  // (Function::apply builds no backward node for an input without a gradient: the
  // blocks' parameters would get none.)
  if (recompute && !x.requires_grad()) x = x.detach().requires_grad_(true);
  // FSDP by blocks: each block's hooks around its forward, and registered for its backward
  // on the gradients of its input (after it) and of its output (before it).
  auto* const hooks = hooks_;
  const bool graph = torch::GradMode::is_enabled();
  // (A leaf's hook runs as its gradient is accumulated, which may come before the first
  // block's parameters' are; a view's runs once the block's backward is done: the
  // engine accumulates a parameter's gradient as soon as it is ready.)
  if (hooks && graph && x.requires_grad() && x.is_leaf()) x = x.view_as(x);
  for (int i = range_.first; i < range_.last; ++i) {
    if (hooks) {
      hooks->before(i, false);
      if (graph && x.requires_grad())
        x.register_hook([hooks, i, first = range_.first](const torch::Tensor&) {
          hooks->after(i, true);
          if (i > first) hooks->before(i - 1, true);
        });
    }
    x = recompute ? recomputed_block(x, *this, i, docs) : block(x, i, nullptr, block_pass::plain, docs);
    if (hooks) hooks->after(i, false);
  }
  if (hooks && graph && x.requires_grad() && range_.last > range_.first)
    x.register_hook([hooks, last = range_.last - 1](const torch::Tensor&) { hooks->before(last, true); });
  if (is_last()) x = final_norm(x);
  // (The last stage's enters its column-parallel output layer: each rank's share of the
  // gradient summed.)
  if (sequence()) x = tp::gather_sequence(x, group(), /*reduce_grad=*/is_last());
  return x;
}

torch::Tensor decoder_slice::forward_cached(const torch::Tensor& input, kv_cache& cache) {
  if (cp_.active()) throw model_error("generation with context parallelism (a slice of whole sequences generates)");
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
  for (int i = range_.first; i < range_.last; ++i) x = block(x, i, &cache, block_pass::plain);
  cache.length = from + T;
  return is_last() ? final_norm(x) : x;
}

torch::Tensor decoder_slice::logits(const torch::Tensor& output) {
  auto l = own_logits(output);
  return tp_.active() ? tp::gather_dim(l, -1, group()) : l;
}

torch::Tensor decoder_slice::loss(const torch::Tensor& output, const torch::Tensor& target_in) {
  // (Context parallelism: the mean over this rank's tokens; the group's ranks hold equal
  // shares, so the mean of their means is the sequences'.)
  const auto target = cp_.active() ? cp::local_tokens(target_in, 1, cp_.size, cp_.rank) : target_in;
  auto l = own_logits(output);
  if (tp_.active()) return tp::vocab_cross_entropy(l.to(torch::kFloat32), target, vocab_first_, group());
  return F::cross_entropy(l.view({-1, l.size(-1)}), target.reshape({-1}));
}

torch::Tensor decoder_slice::run_block(const torch::Tensor& x, int i, block_pass pass,
                                       const window_documents& documents) {
  return block(x, i, nullptr, pass, documents);
}

part_context decoder_slice::context(bool sequence, block_pass pass) {
  return part_context{family_, cfg_, *this, defer_, tp_, sequence, pass, heads_, kv_heads_, &cp_};
}

torch::Tensor decoder_slice::block(const torch::Tensor& x, int i, kv_cache* cache, block_pass pass,
                                   const window_documents& documents) {
  const auto c = context(sequence() && !cache, pass);
  // Selective recompute wraps the attention's core (not in generation, nor without a graph).
  const bool selective = recompute_ == recompute_mode::selective && !cache && torch::GradMode::is_enabled();
  const auto& mask = documents.mask;
  const auto& numbers = documents.numbers;
  const attention_core core = [this, selective, &mask, &numbers](const torch::Tensor& q, const torch::Tensor& k,
                                                                 const torch::Tensor& v, std::int64_t past) {
    // (Context parallelism: the group's core, whose backward recomputes the scores block
    // by block: selective recompute's saving already.)
    if (cp_.active()) return cp::attention(q, k, v, cp_, cfg_.seq_len, window_, numbers);
    return selective ? recomputed_attention(q, k, v, *core_, mask) : (*core_)(q, k, v, past, mask);
  };
  expert_tally tally{ep_, aux_scale_, aux_sum_, expert_tokens_};
  return decoder_block(c, x, i, cache, i - range_.first,
                       {core, rotary_ ? &*rotary_ : nullptr, tally, documents.positions});
}

torch::Tensor decoder_slice::own_logits(const torch::Tensor& output) {
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

torch::Tensor decoder_slice::embed(const torch::Tensor& tokens, std::int64_t from, bool sequence,
                                   const torch::Tensor& positions) {
  torch::Tensor x;
  auto rows = positions;
  if (!tp_.active()) {
    x = torch::embedding(param(embedding_), tokens);
  } else {
    x = tp::vocab_embedding(tokens, param(embedding_), vocab_first_);
    x = sequence ? tp::reduce_scatter_sequence(x, group()) : tp::reduce_from(x, group());
    if (sequence) from += x.size(1) * tp_.rank;
    if (sequence && rows.defined()) rows = rows.narrow(1, from, x.size(1));  // this rank's tokens'
  }
  if (family_.positions != position_kind::learned) return x;  // rotary: positions enter in the attention
  return add_learned_positions(x, param(family_.position_embedding), from, tokens.device(), rows);
}

torch::Tensor decoder_slice::to_residual(const torch::Tensor& x) const {
  if (residual_ == torch::kFloat32 || x.scalar_type() == residual_ || !x.is_floating_point() ||
      current_precision(x.device()) != residual_)
    return x;
  return x.to(residual_);
}

torch::Tensor decoder_slice::final_norm(const torch::Tensor& x) {
  return norm(context(false, block_pass::plain), x, family_.final_norm);
}

collective_group& decoder_slice::group() const { return group_of(tp_); }

void decoder_slice::set_context_parallel(context_parallel cp) {
  if (cp.active()) {
    if (cfg_.seq_len % (2 * cp.size) != 0)
      throw model_error("context_parallel " + std::to_string(cp.size) + ": seq_len " + std::to_string(cfg_.seq_len) +
                        " does not cut into 2 x " + std::to_string(cp.size) + " equal chunks");
    if (!cp.group || cp.group->size() != cp.size || cp.group->rank() != cp.rank)
      throw model_error("context-parallel rank " + std::to_string(cp.rank) + " of " + std::to_string(cp.size) +
                        " without its group");
  }
  cp_ = std::move(cp);
}

}  // namespace troupe
