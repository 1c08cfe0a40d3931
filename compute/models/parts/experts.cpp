#include "compute/models/parts/experts.hpp"

#include <cmath>
#include <tuple>

#include <torch/autograd.h>
#include <torch/torch.h>

#include "compute/parallel/expert_parallel.hpp"
#include "compute/parallel/tensor_parallel.hpp"

namespace troupe {

param_table expert_params(const decoder_family& f, const decoder_config& c, const std::string& block) {
  const auto& o = f.experts;
  const std::string p = block + o.prefix;
  const std::int64_t d = c.d_model, ef = c.expert_d_ff();
  const double proj_std = 0.02 / std::sqrt(2.0 * c.n_layer);
  using I = param_spec::init;
  param_table out{{p + o.router + ".weight", {c.n_experts, d}, I::normal, 0.02, true}};
  for (int e = 0; e < c.n_experts; ++e) {
    const std::string x = p + o.experts + std::to_string(e) + ".";
    out.insert(out.end(), {{x + o.gate + ".weight", {ef, d}, I::normal, 0.02, true},
                           {x + o.down + ".weight", {d, ef}, I::normal, proj_std, true},
                           {x + o.up + ".weight", {ef, d}, I::normal, 0.02, true}});
  }
  return out;
}

namespace {

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

/// The capacity factor (Megatron's token dropping, drop policy "probs", per sequence so
/// that no layout changes it): of each sequence's (token, choice) pairs routed to an
/// expert, the `capacity` with the highest router probability stay (ties: the earlier
/// token); the others get expert E (none). `chosen` (B T, k); returns the same shape.
torch::Tensor drop_past_capacity(const decoder_config& cfg, const torch::Tensor& probs, const torch::Tensor& chosen,
                                 std::int64_t B, std::int64_t capacity) {
  const std::int64_t E = cfg.n_experts, N = chosen.size(0), T = N / B;
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

/// `chosen` (B T, k) less the pairs past their experts' capacity in each sequence
/// (drop_past_capacity). Under sequence parallelism this rank holds T of each sequence's
/// T x size tokens, and under context parallelism its context-parallel rank holds chunks
/// i and 2C-1-i: the router's probabilities of the whole sequences are gathered over the
/// groups (no gradient; the context-parallel ranks' tokens put back in sequence order),
/// every rank decides for the whole sequences, the same way (the stable sorts of the
/// same values), and keeps its own positions.
torch::Tensor within_capacity(const part_context& c, const torch::Tensor& probs, const torch::Tensor& chosen,
                              std::int64_t B) {
  const std::int64_t T = chosen.size(0) / B;
  const bool split = c.cp && c.cp->active();
  if (!c.slice_sequence() && !split) return drop_past_capacity(c.cfg, probs, chosen, B, c.cfg.expert_capacity(T));
  const std::int64_t E = probs.size(1), k = chosen.size(1);
  auto all = probs.view({B, T, E});
  if (c.slice_sequence()) all = tp::gather_dim(all, 1, c.group());  // this context-parallel rank's tokens
  const std::int64_t local = all.size(1);
  if (split) {  // every rank's tokens, in rank order, then in sequence order
    const int C = c.cp->size;
    const auto gathered = tp::gather_dim(all, 1, *c.cp->group);
    all = torch::empty_like(gathered).index_copy_(1, cp::all_positions(local * C, C, gathered.device()), gathered);
  }
  const std::int64_t whole = all.size(1);
  all = all.reshape({B * whole, E});
  const auto all_chosen =
      std::get<1>(torch::sort(all, /*stable=*/true, /*dim=*/-1, /*descending=*/true)).narrow(1, 0, k);
  auto kept = drop_past_capacity(c.cfg, all, all_chosen, B, c.cfg.expert_capacity(whole)).view({B, whole, k});
  if (split) kept = cp::local_tokens(kept, 1, c.cp->size, c.cp->rank);
  if (c.slice_sequence()) kept = kept.narrow(1, T * c.tp.rank, T);
  return kept.reshape({B * T, k});
}

/// Expert e of the layer named `p`: w2(silu(w1(x)) * w3(x)).
torch::Tensor expert(const part_context& c, const torch::Tensor& x, const std::string& p, std::int64_t e) {
  const auto& o = c.family.experts;
  const std::string w = p + o.experts + std::to_string(e) + ".";
  return c.linear(torch::silu(c.linear(x, w + o.gate, false)) * c.linear(x, w + o.up, false), w + o.down, false);
}

/// Every expert here, each on the tokens that chose it, summed into the tokens' rows in
/// expert order.
torch::Tensor local_experts(const part_context& c, const torch::Tensor& x, const torch::Tensor& chosen,
                            const torch::Tensor& weights, const std::string& p) {
  torch::Tensor out = torch::zeros_like(x);
  for (std::int64_t e = 0; e < c.cfg.n_experts; ++e) {
    const auto hit = chosen.eq(e);  // (N, k)
    const auto rows = hit.any(1).nonzero().squeeze(1);
    if (rows.numel() == 0) continue;  // no token for this expert: no gradient either
    const auto ye = expert(c, x.index_select(0, rows), p, e);
    const auto we = (weights * hit.to(weights.scalar_type())).sum(1).index_select(0, rows);
    // (Summed in the block's activation dtype, as Hugging Face's Mixtral does: under bf16
    // autocast the experts compute in bf16, their weighted outputs add up in fp32.)
    out = out.index_add(0, rows, (ye * we.unsqueeze(1).to(ye.scalar_type())).to(out.scalar_type()));
  }
  return out;
}

/// Expert parallelism (compute/parallel/expert_parallel.hpp): this rank's tokens' (token, choice)
/// pairs go to their experts' ranks, this rank's experts run on what came, the results
/// go back; each token sums its choices in expert order, as the loop above does.
torch::Tensor parallel_experts(const part_context& c, const expert_parallel& ep, const torch::Tensor& x,
                               const torch::Tensor& chosen, const torch::Tensor& weights, const std::string& p) {
  // A forward recomputed inside a backward calls the backwards' group (the order of
  // each group's calls is the same on every rank).
  auto& g = c.pass == block_pass::recomputing ? ep.backward() : *ep.group;
  const std::int64_t k = chosen.size(1), local = c.cfg.n_experts / g.size(), first = local * g.rank();
  const auto plan = ep::plan_dispatch(chosen, c.cfg.n_experts, g);
  const auto token = plan.order.div(k, "floor").to(x.device());  // each sorted pair's token
  const auto received = ep::all_to_all(x.index_select(0, token), g, ep.backward(), plan.send_rows, plan.recv_rows);
  // Every received row is some local expert's, so each is overwritten below; starting
  // from the rows times 0 keeps both all-to-alls in the graph on every rank, also on one
  // whose experts got no row (its backward must still take part in theirs).
  torch::Tensor results = received.mul(0);
  for (std::int64_t j = 0; j < local; ++j) {
    const auto rows = plan.rows_of_expert[std::size_t(j)].to(x.device());
    if (rows.numel() == 0) continue;  // no token for this expert: no gradient either
    const auto ye = expert(c, received.index_select(0, rows), p, first + j);
    results = results.index_copy(0, rows, ye.to(results.scalar_type()));
  }
  const auto back = ep::all_to_all(results, g, ep.backward(), plan.recv_rows, plan.send_rows);  // sorted pairs' order
  const auto we = weights.reshape({-1}).index_select(0, plan.order.to(x.device()));
  return torch::zeros_like(x).index_add(0, token, back * we.unsqueeze(1).to(back.scalar_type()));
}

}  // namespace

torch::Tensor experts(const part_context& c, const torch::Tensor& g, const std::string& block, int layer,
                      expert_tally& tally) {
  const auto& o = c.family.experts;
  const std::string p = block + o.prefix;
  const auto B = g.size(0), T = g.size(1), d = g.size(2);
  const std::int64_t E = c.cfg.n_experts, k = c.cfg.moe_top_k;
  const auto x = g.reshape({B * T, d});
  const auto probs = torch::softmax(c.linear(x, p + o.router, false).to(torch::kFloat32), -1);  // (N, E)
  const auto chosen = std::get<1>(torch::sort(probs.detach(), /*stable=*/true, /*dim=*/-1, /*descending=*/true))
                          .narrow(1, 0, k);  // (N, k)
  const auto picked = probs.gather(1, chosen);
  // (N, k), fp32: renormalised to sum 1 (Mixtral's; Qwen3-MoE's with norm_topk_prob)
  const auto weights = c.cfg.moe_norm_topk ? picked / picked.sum(1, /*keepdim=*/true) : picked;
  // A training forward (with a graph, or a full recompute's forward without one and its
  // rerun in the backward) drops what exceeds the experts' capacity; a dropped pair's
  // expert is E, no expert's.
  const bool graph = torch::GradMode::is_enabled(), training = graph || c.pass != block_pass::plain;
  const auto routed = training && c.cfg.moe_capacity_factor > 0 ? within_capacity(c, probs.detach(), chosen, B) : chosen;
  torch::Tensor out = tally.ep.active() ? parallel_experts(c, tally.ep, x, routed, weights, p)
                                       : local_experts(c, x, routed, weights, p);
  out = out.view({B, T, d});
  // A training forward counts its load-balancing loss once (not when a full recompute
  // runs the block again) and back-propagates it where a graph is built.
  const bool counts_aux = c.pass != block_pass::recomputing && (graph || c.pass == block_pass::checkpointing);
  if (counts_aux) {  // the pairs per expert, then those dropped (metrics), once per training forward
    const auto n = torch::bincount(routed.reshape({-1}), /*weights=*/{}, E + 1);
    auto& sum = tally.tokens[layer];
    sum = sum.defined() ? sum + n : n;
  }
  if ((!graph && !counts_aux) || c.cfg.moe_aux_coeff == 0) return out;
  // Per sequence: f_e = its tokens' choices of e / (k T), P_e = the mean of p_e over its
  // tokens; aux = coeff E sum_e f_e P_e, the mean over the micro-batch's sequences. Under
  // sequence parallelism each rank holds T / size tokens of every sequence: the sums are
  // all-reduced over the group (identity backward, so each rank's gradient reaches its
  // own tokens' probabilities; the router's are summed over the group as the norms').
  // Context parallelism likewise, over its group (the router's gradients are then summed
  // over the data x context ranks as every parameter's).
  const auto counts = torch::zeros({B * T, E}, probs.options()).scatter_add_(1, chosen, torch::ones_like(picked.detach()));
  auto f = counts.view({B, T, E}).sum(1);
  auto P = probs.view({B, T, E}).sum(1);
  std::int64_t seq_len = T;
  if (c.slice_sequence()) {
    f = tp::reduce_from(f, c.group());
    P = tp::reduce_from(P, c.group());
    seq_len *= c.tp.size;
  }
  if (c.cp && c.cp->active()) {
    f = tp::reduce_from(f, *c.cp->group);
    P = tp::reduce_from(P, *c.cp->group);
    seq_len *= c.cp->size;
  }
  f = f / double(k * seq_len);
  P = P / double(seq_len);
  const auto aux = (f * P).sum(1).mean() * (c.cfg.moe_aux_coeff * double(E));
  if (counts_aux) {
    const auto counted = aux.detach() * tally.aux_scale;
    tally.aux_sum = tally.aux_sum.defined() ? tally.aux_sum + counted : counted;
  }
  return graph ? add_aux_loss::apply(out, aux, tally.aux_scale) : out;
}

}  // namespace troupe
