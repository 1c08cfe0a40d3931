// Forward-only evaluation at a stage, between steps (actors/stage/logic.hpp).
#include "actors/stage/logic.hpp"

namespace troupe::stage_detail {

bool stage_logic::eval_accepts(std::int64_t step, const char* what) {
  if (step == s_.step && !s_.running) return true;
  spdlog::warn("{}: evaluation {} after step {} dropped (the stage is at step {}{})", s_.name, what, step + 1,
               s_.step + 1, s_.running ? ", running" : "");
  return false;
}

void stage_logic::on_eval_activation(const eval_activation& msg) {
  if (!eval_accepts(msg.step, "activation")) return;
  const auto& ctx = *s_.ctx;
  const int x = s_.virtual_of(msg.chunk);
  if (msg.chunk < 0 || msg.chunk >= ctx.v) return fail("evaluation activation for chunk " + std::to_string(msg.chunk));
  // Any number of rows (a forward's windows), at least one: no rows or no shape fails the check.
  const std::int64_t rows = msg.data.shape.empty() ? 1 : std::max<std::int64_t>(1, msg.data.shape[0]);
  const auto problem = x > 0 ? check_payload(msg.data, ctx.activation_shape(x, rows), ctx.compute_dtype)
                             : check_payload(msg.data, ctx.input_shape(rows), ctx.input_dtype());
  if (!problem.empty()) return fail("evaluation activation of forward " + std::to_string(msg.index) + ": " + problem);
  if (s_.group_size() == 1) return run_eval_forward(msg);
  // Expert and tensor parallelism: in (forward, chunk) order over the group's forwards
  // (forward f goes to group f mod groups). Every stage holds a chunk of every forward,
  // and each (forward, virtual stage) needs only earlier ones, so this order cannot stall.
  const int groups = ctx.pipes / s_.group_size();
  if (s_.eval_next.first < 0) s_.eval_next = {s_.replica / s_.group_size(), 0};
  if (msg.index % groups != s_.replica / s_.group_size() || key{msg.index, msg.chunk} < s_.eval_next ||
      !s_.eval_waiting.emplace(key{msg.index, msg.chunk}, msg).second)
    return fail("evaluation activation of forward " + std::to_string(msg.index) + ", chunk " +
                std::to_string(msg.chunk) + " out of its group's order");
  for (auto it = s_.eval_waiting.find(s_.eval_next); it != s_.eval_waiting.end(); it = s_.eval_waiting.find(s_.eval_next)) {
    const auto next = std::move(it->second);
    s_.eval_waiting.erase(it);
    s_.eval_next = s_.eval_next.second + 1 < ctx.v ? key{s_.eval_next.first, s_.eval_next.second + 1}
                                                   : key{s_.eval_next.first + groups, 0};
    run_eval_forward(next);
  }
}

void stage_logic::run_eval_forward(const eval_activation& msg) {
  const auto& ctx = *s_.ctx;
  const int x = s_.virtual_of(msg.chunk);
  if (s_.faults.stage_throws(s_.replica, s_.stage, s_.step, 0, throw_point::in_evaluation)) {  // fault injection
    spdlog::warn("fault injected: {} throws in the evaluation after step {} (index {})", s_.name, s_.step + 1, s_.step);
    throw std::runtime_error("injected fault: " + s_.name + " throws in the evaluation after step " +
                             std::to_string(s_.step + 1));
  }
  // (A loader's windows through to_device; another stage's activation as it came: a
  // transport may hand over a buffer it reuses.)
  if (ctx.shards_params())  // (the coordinator evaluates a sharded model from its shards: eval_mode gather)
    return fail("evaluation forward " + std::to_string(msg.index) + " with the parameters sharded");
  auto in = x == 0 ? to_device(tensor_of(msg.data)) : tensor_of(msg.data).to(ctx.device);
  std::string bad;
  const auto positions = positions_of(msg.positions, in.size(0), bad);
  if (!bad.empty()) return fail("evaluation forward " + std::to_string(msg.index) + ": " + bad);
  if (x > 0) in = in.to(ctx.residual_dtype);  // the stage computes from its residual stream's dtype
  trace_event ev{"eval F", s_.replica, s_.stage, msg.index, msg.chunk, s_.step, ctx.now_us(), 0};
  s_.computing_forward = {msg.index, msg.chunk};
  s_.in_backward = false;
  torch::NoGradGuard no_grad;
  torch::Tensor out;
  {
    precision_scope amp(ctx.device, ctx.compute_dtype);
    out = s_.chunks[msg.chunk]->forward(in, positions);
  }
  ev.end_us = ctx.now_us();
  s_.eval_events.push_back(std::move(ev));
  if (!s_.is_last_virtual(msg.chunk)) {
    const auto next = s_.owner(x + 1);
    send_to_stage(next.stage, next.actor,
                  eval_activation{s_.step, msg.index, next.chunk,
                                  make_payload(out.to(ctx.compute_dtype), ctx.cfg.checksum),
                                  optional_payload(positions)});
    return;
  }
  if (!s_.scores_evaluation()) return;
  s_.eval_outputs[msg.index] = out;
  score_eval(msg.index);
}

void stage_logic::on_eval_target(const eval_target& msg) {
  if (!eval_accepts(msg.step, "target")) return;
  const auto problem = check_payload(msg.data, msg.data.shape, torch::kInt64);
  if (!problem.empty()) return fail("evaluation target of forward " + std::to_string(msg.index) + ": " + problem);
  s_.eval_targets[msg.index] = to_device(tensor_of(msg.data));
  score_eval(msg.index);
}

void stage_logic::score_eval(int index) {
  if (s_.tp_size == 1 && s_.cp_size == 1) return score_eval_now(index);
  const int groups = s_.ctx->pipes / s_.group_size();
  if (s_.score_next < 0) s_.score_next = s_.replica / s_.group_size();
  while (s_.eval_outputs.count(s_.score_next) && s_.eval_targets.count(s_.score_next)) {
    const int next = s_.score_next;
    s_.score_next += groups;
    score_eval_now(next);
  }
}

void stage_logic::score_eval_now(int index) {
  const auto out = s_.eval_outputs.find(index);
  const auto target = s_.eval_targets.find(index);
  if (out == s_.eval_outputs.end() || target == s_.eval_targets.end()) return;
  const auto& ctx = *s_.ctx;
  if (out->second.size(0) != target->second.size(0))
    return fail("evaluation forward " + std::to_string(index) + ": " + std::to_string(out->second.size(0)) +
                " rows but " + std::to_string(target->second.size(0)) + " targets");
  torch::NoGradGuard no_grad;
  eval_score score;
  {
    precision_scope amp(ctx.device, ctx.compute_dtype);
    score = score_evaluation(*s_.chunks.at(ctx.place(ctx.n_virtual - 1).second), out->second, target->second, ctx.spec.type == model_spec::kind::decoder);
  }
  if (s_.cp_size > 1) {  // each rank's loss is the mean over its tokens: the group's mean of them
    auto both = torch::tensor({score.weighted, score.correct}, torch::kFloat64);
    s_.cp_group->all_reduce(both);
    score.weighted = both[0].item<double>() / s_.cp_size;
    score.correct = both[1].item<double>();
  }
  s_.eval_outputs.erase(out);
  s_.eval_targets.erase(target);
  if (!s_.reports_evaluation()) return;
  const eval_result result{s_.step, s_.replica, index, score.weighted, score.correct};
  if (!report_fault(s_.wiring->coordinator, message_target::eval_result, "evaluation result", result))
    self_->send(s_.wiring->coordinator, result);
}

}  // namespace troupe::stage_detail
