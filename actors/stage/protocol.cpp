// A step's messages at a stage: reset, acceptance, duplicates, what it waits for
// (actors/stage/logic.hpp).
#include "actors/stage/logic.hpp"
#include "actors/wait_graph.hpp"

namespace troupe::stage_detail {

reset_report stage_logic::reset() {
  reset_report rep{s_.name, {}};
  auto leftover = [&](std::size_t n, const char* what) {
    if (n) rep.leftovers.push_back(std::to_string(n) + " " + what);
  };
  leftover(s_.inputs.size(), "buffered input(s)/activation(s)");
  leftover(s_.out_grads.size(), "buffered output gradient(s)");
  leftover(s_.targets.size(), "buffered target(s)");
  leftover(s_.saved.size(), "activation(s) held for backward");
  leftover(s_.deferred.size(), "weight gradient(s) waiting for their W");
  leftover(s_.stash.size(), "stashed message(s)");
  leftover(s_.in_flight != 0, "nonzero in-flight count");
  leftover(s_.tied_pending || s_.tied_in.defined(), "pending tied gradient");
  leftover(s_.eval_outputs.size(), "evaluation output(s) waiting for targets");
  leftover(s_.eval_targets.size(), "evaluation target(s) waiting for outputs");
  leftover(s_.eval_waiting.size(), "evaluation activation(s) waiting for their turn");
  s_.eval_outputs.clear();
  s_.eval_targets.clear();
  s_.eval_waiting.clear();
  s_.eval_next = {-1, 0};
  s_.score_next = -1;
  s_.eval_events.clear();
  s_.seen.clear();
  s_.inputs.clear();
  s_.out_grads.clear();
  s_.targets.clear();
  s_.positions.clear();
  s_.losses.clear();
  s_.saved.clear();
  s_.deferred.clear();
  s_.stash.clear();
  s_.tied_in = torch::Tensor();
  s_.tied_pending = false;
  for (auto& w : s_.watches) w->disarm();
  for (auto& h : s_.held) h.clear();
  s_.in_flight = s_.peak_in_flight = s_.forwards_done = 0;
  s_.events.clear();
  s_.running = false;
  // Each gradient must still be a view of the zeroed buffer (a gradient autograd replaced
  // would not be zeroed, nor reach the shard). Only pointers are compared: a pass over the
  // buffer would cost a read of every gradient and, on a GPU, a host synchronisation per step.
  for (std::size_t i = 0; i < s_.sharded.size(); ++i) {  // FSDP: nothing gathered or made between steps
    release_params(s_.sharded[i]);
    for (auto& u : s_.sharded[i].units) release_storage(u.grads);  // (by chunks: the flat buffer)
    s_.sharded[i].grads.zero_();
  }
  s_.fsdp_pool.clear();
  for (auto& t : s_.fsdp_tied)
    if (t.defined()) t.zero_();
  for (auto& c : s_.chunks) {
    if (!storage_held(c->flat_grads())) continue;
    c->zero_grads();
    const auto* begin = static_cast<const char*>(c->flat_grads().data_ptr());
    const auto* end = begin + c->flat_grads().nbytes();
    for (const auto& p : c->parameters()) {
      const auto* at = static_cast<const char*>(p.grad().data_ptr());
      if (at < begin || at >= end) rep.leftovers.push_back("a gradient is no longer a view of the grad buffer");
    }
  }
  return rep;
}

bool stage_logic::accept(std::int64_t step) {
  if (step == s_.step) return true;
  if (step > s_.step) s_.stash.push_back(self_->current_mailbox_element()->move_content_to_message());
  return false;
}

void stage_logic::receive(std::map<key, torch::Tensor>& into, std::int64_t step, int mb, int chunk, const tensor_payload& data,
             const std::vector<std::int64_t>& shape, const char* what, const tensor_payload* positions) {
  if (!accept(step)) return;
  if (!first_time(&into == &s_.inputs ? received::activation : received::gradient, {mb, chunk}, what)) return;
  auto problem = check_payload(data, shape, s_.ctx->compute_dtype);
  if (!problem.empty()) return fail(std::string(what) + " of micro-batch " + std::to_string(mb) + ": " + problem);
  if (positions) {
    auto p = positions_of(*positions, shape.front(), problem);
    if (!problem.empty()) return fail(std::string(what) + " of micro-batch " + std::to_string(mb) + ": " + problem);
    if (p.defined()) s_.positions[mb] = std::move(p);
  }
  // The stage computes from its residual stream's dtype (fp32 unless fp32_residual = false).
  into[{mb, chunk}] = tensor_of(data).to(s_.ctx->device, s_.ctx->residual_dtype);
  trace_comm("recv", what, mb, chunk, s_.ctx->now_us(), payload_bytes(data));
  run_ready();
}

torch::Tensor stage_logic::positions_of(const tensor_payload& p, std::int64_t rows, std::string& problem) const {
  problem.clear();
  const bool documents = s_.ctx->cfg.document_attention;
  if (!p.local.defined() && p.dtype < 0) {
    if (documents) problem = "no document positions (the job attends by documents)";
    return {};
  }
  if (!documents) {
    problem = "document positions in a job without document attention";
    return {};
  }
  problem = check_payload(p, {rows, s_.ctx->spec.decoder.seq_len}, torch::kInt64);
  if (!problem.empty()) {
    problem = "document positions: " + problem;
    return {};
  }
  return tensor_of(p).cpu();
}

void stage_logic::trace_comm(const char* dir, const char* what, int mb, int chunk, double start_us, std::int64_t bytes) {
  push_event({std::string(dir) + " " + what, s_.replica, s_.stage, mb, chunk, s_.step, start_us, s_.ctx->now_us(),
              bytes});
}

bool stage_logic::first_time(received kind, key k, const char* what) {
  if (s_.seen.insert({kind, k}).second) return true;
  spdlog::warn("{}: duplicate {} of micro-batch {} (chunk {}) in step {} dropped", s_.name, what, k.first, k.second,
               s_.step + 1);
  return false;
}

void stage_logic::fail(const std::string& what) {
  self_->send(s_.wiring->coordinator, runtime_failure{s_.step, s_.name, what, s_.wiring->generation});
}

stage_state::sent_message stage_logic::sent_of(const forward_activation& m, int to) {
  return {stage_state::sent_message::activation, m.mb, m.chunk, to};
}

stage_state::sent_message stage_logic::sent_of(const backward_grad& m, int to) {
  return {stage_state::sent_message::gradient, m.mb, m.chunk, to};
}

stage_state::sent_message stage_logic::sent_of(const tied_grad&, int to) {
  return {stage_state::sent_message::tied, 0, 0, to};
}

wait_report stage_logic::waits(std::int64_t step) {
  wait_report rep;
  rep.actor = s_.name;
  rep.node = s_.wiring->node;
  {
    std::lock_guard<std::mutex> lock(s_.sent_mutex);
    if (s_.step == step)
      for (const auto& m : s_.sent) rep.sent.push_back(s_.sent_key(m));
  }
  auto wait = [&](std::string what, const std::string& from) {
    rep.keys = {message_key(what, from, s_.name)};
    rep.waits_for = std::move(what);
    rep.from = {from};
  };
  if (report_other_step(rep, s_.step, step)) return rep;
  rep.state = "ran " + std::to_string(s_.ops_done) + " of " + std::to_string(s_.total_ops) + " ops" +
              (!s_.last_op ? ""
                           : " (last " + std::string(op_letter(s_.last_op->kind)) + std::to_string(s_.last_op->mb) +
                                 (s_.ctx->v > 1 ? " chunk " + std::to_string(s_.last_op->chunk) : "") + ")");
  if (s_.running) {
    const auto op = next_blocked_op();
    if (!op) {
      rep.state += ", runnable";
      return rep;
    }
    const int x = s_.virtual_of(op->chunk);
    const auto mb = std::to_string(op->mb);
    if (op->kind == op_kind::backward)
      wait(gradient_text(op->mb, op->chunk), s_.owner_name(x + 1));
    else if (s_.inputs.count({op->mb, op->chunk}))
      wait("target mb " + mb, s_.loader_name());
    else if (x == 0)
      wait("input mb " + mb, s_.loader_name());
    else
      wait(activation_text(op->mb, op->chunk), s_.owner_name(x - 1));
    return rep;
  }
  if (s_.done_reported) {
    rep.state += ", done";
    return rep;
  }
  if (s_.tied_pending) {
    wait("tied gradient", s_.ctx->stage_name(s_.replica, s_.tied_peer()));
    return rep;
  }
  for (int c = 0; c < s_.ctx->v; ++c)
    if (!s_.seen.count({received::parameters, {c, 0}})) {
      wait("parameters of chunk " + std::to_string(c), s_.shard_name());
      return rep;
    }
  rep.state += ", done";
  return rep;
}

std::optional<pipeline_op> stage_logic::next_blocked_op() const {
  if (s_.order) {
    if (s_.next_op >= s_.order->size()) return std::nullopt;
    const auto& op = (*s_.order)[s_.next_op];
    return op.kind == op_kind::weight || ready(op) ? std::nullopt : std::optional<pipeline_op>(op);
  }
  for (const auto& [k, sv] : s_.saved) {
    pipeline_op op{op_kind::backward, k.first, k.second};
    if (!ready(op)) return op;
  }
  for (int c = 0; c < s_.ctx->v; ++c)
    for (int mb = 0; mb < s_.ctx->m; ++mb) {
      const key k{mb, c};
      pipeline_op op{op_kind::forward, mb, c};
      if (!s_.saved.count(k) && !s_.seen.count({received::activation, k}) &&
          !(s_.virtual_of(c) == 0 && s_.seen.count({received::input, {mb, 0}})))
        return op;
    }
  return std::nullopt;
}

}  // namespace troupe::stage_detail
