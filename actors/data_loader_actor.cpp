#include "actors/data_loader_actor.hpp"

#include <caf/all.hpp>
#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include "actors/simulated/simulated.hpp"
#include "compute/trainer/local_trainer.hpp"
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
  if (s.step == step)  // what it sent: micro-batches 0 .. next_mb - 1 (their keys made only when asked)
    for (int k = 0; k < s.next_mb; ++k) {
      rep.sent.push_back(message_key("input mb " + std::to_string(k), s.name, s.ctx->stage_name(s.replica, 0)));
      rep.sent.push_back(
          message_key("target mb " + std::to_string(k), s.name, s.ctx->stage_name(s.replica, s.ctx->loss_stage())));
    }
  rep.state = "sent " + std::to_string(s.next_mb) + " of " + std::to_string(s.ctx->m) + " micro-batches";
  if (s.step == step && s.next_mb < s.ctx->m) {
    const auto stage0 = s.ctx->stage_name(s.replica, 0);
    rep.waits_for = "credit mb " + std::to_string(s.next_mb - s.ctx->ahead);
    rep.from = {stage0};
    rep.keys = {message_key(rep.waits_for, stage0, s.name)};
  }
  return rep;
}

using loader_self = loader_actor::stateful_pointer<loader_state>;

void send_next(loader_self self) {
  auto& s = self->state;
  const auto& ctx = *s.ctx;
  const int k = s.next_mb++;
  // Replica r takes block [r B/d, (r+1) B/d) of the step's samples; micro-batch k the
  // k-th contiguous block of that (tensor and context parallelism: each pipeline of the
  // replica the same; a context-parallel rank's first stage takes its tokens).
  const auto& row = s.wiring->stages[s.replica];
  if (!s.data) {  // compute simulated: the micro-batch's dtype and shape, no tokens
    tensor_payload sized;
    sized.dtype = std::int8_t(ctx.input_dtype());
    sized.shape = ctx.input_shape();
    self->send(row.front(), microbatch_input{s.step, k, sized, {}});
    self->send(row.at(ctx.loss_stage()), microbatch_target{s.step, k, std::move(sized)});
    return;
  }
  auto b = s.data->samples(int(s.step), ctx.data_of(s.replica) * ctx.m * ctx.mbs + k * ctx.mbs, ctx.mbs);
  self->send(row.front(), microbatch_input{s.step, k, make_payload(b.input), optional_payload(b.positions)});
  self->send(row.at(ctx.loss_stage()), microbatch_target{s.step, k, make_payload(b.target)});
}

loader_actor::behavior_type feeding(loader_self self);

/// Step `msg.step` begins: its first `ahead` micro-batches go out at once (by default all).
void start_step(loader_self self, const begin_step& msg);

/// What both phases answer alike: the hang probe, the reset check, an abort.
auto wait_handler(loader_self self) {
  return [self](wait_atom, std::int64_t step) -> caf::result<wait_report> {
    const auto& s = self->state;
    if (s.ctx->simulated && s.ctx->simulated->groups->silent(s.wiring->node))
      return self->make_response_promise<wait_report>();  // (a silent simulated node: never answered)
    return loader_waits(s, step);
  };
}

auto reset_handler(loader_self self) {
  return [self](const reset_step&) -> reset_report {
    reset_report rep{self->state.name, {}};
    if (self->state.next_mb != self->state.ctx->m)
      rep.leftovers.push_back(std::to_string(self->state.ctx->m - self->state.next_mb) + " micro-batch(es) never sent");
    return rep;
  };
}

/// Step `msg.step` was aborted: nothing of it is owed any more.
void owe_nothing(loader_state& s, const abort_step& msg) {
  s.step = msg.step;
  s.next_mb = s.ctx->m;
}

/// Idle: every micro-batch of the step is sent (or none began): a credit now is stale.
loader_actor::behavior_type idle(loader_self self) {
  return {
      [self](const begin_step& msg) { start_step(self, msg); },
      [self](const credit& msg) {
        spdlog::debug("{}: credit of step {} mb {} dropped (all sent)", self->state.name, msg.step + 1, msg.mb);
      },
      wait_handler(self),
      reset_handler(self),
      [self](const abort_step& msg) { owe_nothing(self->state, msg); },
  };
}

/// Feeding: each credit of this step sends the next micro-batch; after the last, idle.
loader_actor::behavior_type feeding(loader_self self) {
  return {
      [self](const begin_step& msg) { start_step(self, msg); },
      [self](const credit& msg) {
        auto& s = self->state;
        if (msg.step != s.step) return;
        send_next(self);
        if (s.next_mb == s.ctx->m) self->become(idle(self));
      },
      wait_handler(self),
      reset_handler(self),
      [self](const abort_step& msg) {
        owe_nothing(self->state, msg);
        self->become(idle(self));
      },
  };
}

void start_step(loader_self self, const begin_step& msg) {
  auto& s = self->state;
  s.step = msg.step;
  s.next_mb = 0;
  while (s.next_mb < s.ctx->ahead) send_next(self);
  self->become(s.next_mb < s.ctx->m ? feeding(self) : idle(self));
}

loader_actor::behavior_type loader_behavior(loader_self self, std::shared_ptr<const runtime_context> ctx,
                                           std::shared_ptr<const job_wiring> wiring, int replica) {
  self->set_exception_handler([](caf::scheduled_actor*, std::exception_ptr& eptr) { return error_from_exception(eptr); });
  auto& st = self->state;
  st.ctx = ctx;
  st.wiring = wiring;
  st.replica = replica;
  st.name = ctx->loader_name(replica);
  // (compute simulated: no data read; the micro-batches are sizes only)
  if (!ctx->simulated) st.data = std::make_unique<training_data>(ctx->cfg, training_data::use::training);
  return idle(self);
}

}  // namespace

loader_actor spawn_data_loader_actor(caf::local_actor* supervisor, std::shared_ptr<const runtime_context> ctx,
                                     std::shared_ptr<const job_wiring> wiring, int replica) {
  return supervisor->spawn<caf::monitored>(loader_behavior, std::move(ctx), std::move(wiring), replica);
}

}  // namespace troupe
