#include "actors/coordinator/state.hpp"

#include <numeric>

#include "actors/request_all.hpp"
#include "actors/trace.hpp"
#include "messages/type_ids.hpp"

namespace troupe::coordinator {

void record_evaluation(self_ptr self, const evaluation& e, double seconds, nlohmann::json& line) {
  for (const auto& [key, value] : e.fields()) line[key] = value;
  line["eval_seconds"] = seconds;
  self->state.result->evaluations.push_back({e, int(self->state.step) + 1});
}

const batch& evaluation_set(self_ptr self) {
  auto& s = self->state;
  if (!s.eval_set) s.eval_set = training_data(s.ctx->cfg, training_data::use::evaluation).evaluation_set();
  return *s.eval_set;
}

void evaluate(self_ptr self, const state_dict& state, nlohmann::json& line, double t0) {
  auto& s = self->state;
  local_pipeline model(s.ctx->spec, state, 1, 1, {}, 1, s.ctx->device);  // on the job's device
  const auto e = evaluate_model(model, evaluation_set(self), s.ctx->spec.type == model_spec::kind::decoder,
                                int(s.step) + 1, s.ctx->cfg.eval_tokens);
  record_evaluation(self, e, (s.ctx->now_us() - t0) * 1e-6, line);
}

void evaluate_in_pipeline(self_ptr self, std::function<void(evaluation)> then) {
  auto& s = self->state;
  const auto& ctx = *s.ctx;
  const auto& set = evaluation_set(self);
  const auto plan = plan_evaluation(set, ctx.spec.type == model_spec::kind::decoder, ctx.cfg.eval_tokens);
  enter(self, phase::evaluating);
  s.eval_scores.assign(plan.size(), {});
  s.seen_evals.assign(plan.size(), false);
  s.n_evals = 0;
  s.eval_then = std::move(then);
  // Expert parallelism: forward f through every pipeline of block f mod (pipes / width),
  // the pipelines of the whole replicas an expert-parallel group spans (EP consecutive
  // pipelines, tensor-parallel rank fastest: width lcm(EP, T)), scored by the block's
  // first replica (the others serve its tokens' experts). Tensor parallelism: that
  // replica's every pipeline scores its part of the vocabulary; context parallelism: the
  // T C pipelines of a replica, each its tokens (width lcm(EP, T C)).
  const int ep = ctx.cfg.expert_parallel, ranks = ctx.t * ctx.c, width = ep / std::gcd(ep, ranks) * ranks,
            groups = ctx.pipes / width;
  for (std::size_t f = 0; f < plan.size(); ++f) {
    const int first = int(f % std::size_t(groups)) * width;
    const auto rows = [&](const torch::Tensor& t) {
      return optional_payload(t.defined() ? t.narrow(0, plan[f].begin, plan[f].rows) : t);
    };
    for (int r = first; r < first + ranks; ++r)
      self->send(s.wiring->stages[r].at(ctx.loss_stage()), eval_target{s.step, std::int32_t(f), rows(set.target)});
    for (int r = first; r < first + width; ++r)
      self->send(s.wiring->stages[r].front(), eval_activation{s.step, std::int32_t(f), 0, rows(set.input), rows(set.positions)});
  }
  self->delayed_send(self, std::chrono::seconds(ctx.cfg.step_timeout), eval_atom_v, s.step);
}

void end_evaluation(self_ptr self) {
  auto& s = self->state;
  request_all<std::vector<trace_event>>(
      self, all_of(s.wiring->stages), state_timeout,
      [self](std::size_t, std::vector<trace_event>& events) {
        auto& all = self->state.result->events;
        all.insert(all.end(), events.begin(), events.end());
      },
      [self] {
        auto& s = self->state;
        enter(self, phase::between_steps);
        const auto e = combine_evaluation(s.eval_scores, evaluation_set(self),
                                          s.ctx->spec.type == model_spec::kind::decoder, 0);  // logged with its time
        auto then = std::move(s.eval_then);
        then(e);
      },
      fail_with(self, "no evaluation events from a stage"), eval_atom_v, s.step);
}

void on_eval_result(self_ptr self, const eval_result& msg) {
  auto& s = self->state;
  if (msg.step != s.step || msg.index < 0 || std::size_t(msg.index) >= s.eval_scores.size()) return;
  if (!first_report(s.seen_evals, std::size_t(msg.index), "evaluation result", s.step)) return;
  s.eval_scores[msg.index] = {msg.weighted, msg.correct};
  if (++s.n_evals == int(s.eval_scores.size())) end_evaluation(self);
}

void on_eval_timeout(self_ptr self, std::int64_t step) {
  auto& s = self->state;
  if (step != s.step) return;
  fail(self, "not finished within " + std::to_string(s.ctx->cfg.step_timeout) + " s (" + std::to_string(s.n_evals) +
                 " of " + std::to_string(s.eval_scores.size()) + " forwards scored)");
}

}  // namespace troupe::coordinator
