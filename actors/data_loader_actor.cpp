#include "actors/data_loader_actor.hpp"

#include <caf/all.hpp>
#include <torch/torch.h>

#include "compute/trainer.hpp"
#include "messages/type_ids.hpp"

namespace troupe {

namespace {

struct loader_state {
  std::shared_ptr<const runtime_context> ctx;
  std::shared_ptr<const job_wiring> wiring;
  int replica = 0;
  std::unique_ptr<training_data> data;
  std::int64_t step = -1;
  int next_mb = 0;
  std::string name;
  std::vector<std::string> sent;  ///< message_key of what it sent this step (wait-for graph)
};

/// What loader `s` waits for in `step`: the credit of stage 0 for its next micro-batch.
wait_report loader_waits(const loader_state& s, std::int64_t step) {
  wait_report rep;
  rep.actor = s.name;
  rep.node = s.wiring->node;
  if (s.step < step) {
    rep.state = "still at step " + std::to_string(s.step + 1);
    rep.waits_for = "begin of step " + std::to_string(step + 1);
    rep.from = {"coordinator"};
    rep.keys = {message_key(rep.waits_for, "coordinator", s.name)};
    return rep;
  }
  rep.sent = s.sent;
  rep.state = "sent " + std::to_string(s.next_mb) + " of " + std::to_string(s.ctx->m) + " micro-batches";
  if (s.step == step && s.next_mb < s.ctx->m) {
    const auto stage0 = s.ctx->stage_name(s.replica, 0);
    rep.waits_for = "credit mb " + std::to_string(s.next_mb - s.ctx->cfg.credit_window);
    rep.from = {stage0};
    rep.keys = {message_key(rep.waits_for, stage0, s.name)};
  }
  return rep;
}

void send_next(caf::stateful_actor<loader_state>* self) {
  torch::set_num_threads(1);  // intra-op threads belong to the stage actors (see runtime.cpp)
  auto& s = self->state;
  const auto& ctx = *s.ctx;
  const int k = s.next_mb++;
  // Replica r takes block [r B/d, (r+1) B/d) of the step's samples; micro-batch k the
  // k-th contiguous block of that (tensor parallelism: each pipeline of the replica the
  // same).
  auto b = s.data->samples(int(s.step), ctx.dp_of(s.replica) * ctx.m * ctx.mbs + k * ctx.mbs, ctx.mbs);
  const auto& row = s.wiring->stages[s.replica];
  s.sent.push_back(message_key("input mb " + std::to_string(k), s.name, ctx.stage_name(s.replica, 0)));
  self->send(row.front(), microbatch_input{s.step, k, make_payload(b.input)});
  s.sent.push_back(message_key("target mb " + std::to_string(k), s.name, ctx.stage_name(s.replica, ctx.loss_stage())));
  self->send(row.at(ctx.loss_stage()), microbatch_target{s.step, k, make_payload(b.target)});
}

caf::behavior loader_behavior(caf::stateful_actor<loader_state>* self, std::shared_ptr<const runtime_context> ctx,
                              std::shared_ptr<const job_wiring> wiring, int replica) {
  self->set_exception_handler([](caf::scheduled_actor*, std::exception_ptr& eptr) { return error_from_exception(eptr); });
  auto& st = self->state;
  st.ctx = ctx;
  st.wiring = wiring;
  st.replica = replica;
  st.name = ctx->loader_name(replica);
  st.data = std::make_unique<training_data>(ctx->cfg, training_data::use::training);
  return {
      [=](const begin_step& msg) {
        auto& s = self->state;
        s.step = msg.step;
        s.next_mb = 0;
        s.sent.clear();
        while (s.next_mb < s.ctx->m && s.next_mb < s.ctx->cfg.credit_window) send_next(self);
      },
      [=](const credit& msg) {
        auto& s = self->state;
        if (msg.step == s.step && s.next_mb < s.ctx->m) send_next(self);
      },
      [=](wait_atom, std::int64_t step) -> wait_report { return loader_waits(self->state, step); },
      [=](const reset_step&) -> reset_report {
        reset_report rep{self->state.name, {}};
        if (self->state.next_mb != self->state.ctx->m)
          rep.leftovers.push_back(std::to_string(self->state.ctx->m - self->state.next_mb) + " micro-batch(es) never sent");
        return rep;
      },
      [=](const abort_step& msg) {
        self->state.step = msg.step;
        self->state.next_mb = self->state.ctx->m;
      },
  };
}

}  // namespace

caf::actor spawn_data_loader_actor(caf::event_based_actor* supervisor, std::shared_ptr<const runtime_context> ctx,
                                   std::shared_ptr<const job_wiring> wiring, int replica) {
  return supervisor->spawn<caf::monitored>(loader_behavior, std::move(ctx), std::move(wiring), replica);
}

}  // namespace troupe
