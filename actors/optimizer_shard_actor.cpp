#include "actors/optimizer_shard_actor.hpp"

#include <caf/all.hpp>
#include <torch/torch.h>

#include "compute/grad_buffer.hpp"
#include "compute/optimizer.hpp"
#include "messages/type_ids.hpp"

namespace troupe {

namespace {

struct shard_state {
  struct chunk_shard {
    flat_range range;
    adamw_shard opt;
    torch::Tensor norm_mask;
    std::vector<torch::Tensor> received;  // per replica, this step
    torch::Tensor reduced;
    std::vector<param_entry> entries;  // the chunk's layout (names and offsets)
  };
  std::shared_ptr<const runtime_context> ctx;
  std::shared_ptr<const job_wiring> wiring;
  int stage = 0, rank = 0;
  std::string name;
  std::vector<chunk_shard> chunks;
  std::int64_t step = -1;
  double lr = 0;
  int received = 0;
  std::vector<trace_event> events;
  std::vector<caf::message> stash;
};

caf::behavior shard_behavior(caf::stateful_actor<shard_state>* self, std::shared_ptr<const runtime_context> ctx,
                             std::shared_ptr<const job_wiring> wiring, int stage, int rank) {
  self->set_exception_handler([](caf::scheduled_actor*, std::exception_ptr& eptr) { return error_from_exception(eptr); });
  auto& st = self->state;
  st.ctx = ctx;
  st.wiring = wiring;
  st.stage = stage;
  st.rank = rank;
  st.name = "shard[stage " + std::to_string(stage) + ", rank " + std::to_string(rank) + "]";
  const adamw_options opts{ctx->cfg.beta1, ctx->cfg.beta2, ctx->cfg.eps, ctx->cfg.weight_decay};
  const std::map<std::string, torch::Tensor> init_by_name(ctx->init.begin(), ctx->init.end());
  for (int c = 0; c < ctx->v; ++c) {
    // A slice only to learn the layout and initial values of this range; dropped at once.
    auto layout = make_slice(ctx->spec, ctx->ranges[c * ctx->p + stage], ctx->init, ctx->d);
    const auto range = shard_ranges(layout->flat_params().numel(), ctx->d)[rank];
    st.chunks.push_back({range,
                         adamw_shard(layout->flat_params().narrow(0, range.begin, range.size()),
                                     decay_mask(layout->entries(), range), opts),
                         norm_mask(layout->entries(), range), std::vector<torch::Tensor>(ctx->d), {}, {}});
    if (!ctx->resume_optim.empty())
      restore_shard(layout->entries(), range, st.chunks.back().opt, init_by_name, ctx->resume_optim, ctx->start_step);
    st.chunks.back().entries = layout->entries();
  }
  auto accept = [self](std::int64_t step) {
    if (step == self->state.step) return true;
    if (step > self->state.step)
      self->state.stash.push_back(self->current_mailbox_element()->move_content_to_message());
    return false;
  };
  auto drop_step_state = [self] {
    reset_report rep{self->state.name, {}};
    int held = 0;
    for (auto& c : self->state.chunks) {
      for (auto& t : c.received) held += t.defined();
      c.received.assign(self->state.ctx->d, torch::Tensor());
      c.reduced = torch::Tensor();
    }
    if (held) rep.leftovers.push_back(std::to_string(held) + " gradient range(s) held");
    if (!self->state.stash.empty())
      rep.leftovers.push_back(std::to_string(self->state.stash.size()) + " stashed message(s)");
    self->state.stash.clear();
    self->state.received = 0;
    self->state.events.clear();
    return rep;
  };
  return {
      [=](const begin_step& msg) {
        auto& s = self->state;
        s.step = msg.step;
        s.lr = msg.lr;
        s.received = 0;
        auto stash = std::move(s.stash);
        s.stash.clear();
        for (auto& m : stash) self->send(self, std::move(m));
      },
      [=](grad_shard& msg) {
        if (!accept(msg.step)) return;
        torch::set_num_threads(1);  // intra-op threads belong to the stage actors (see runtime.cpp)
        auto& s = self->state;
        auto& c = s.chunks.at(msg.chunk);
        const auto problem = check_payload(msg.data, {c.range.size()}, torch::kFloat32);
        if (!problem.empty()) {
          self->send(s.wiring->coordinator, runtime_failure{s.step, s.name, "gradient range: " + problem});
          return;
        }
        c.received.at(msg.replica) = tensor_of(msg.data);
        if (++s.received < s.ctx->d * s.ctx->v) return;
        // Reduce-scatter, in-process: sum the replicas' ranges in replica order.
        trace_event ev{"reduce", 0, s.stage, -1, -1, s.step, s.ctx->now_us(), 0};
        for (int ci = 0; ci < s.ctx->v; ++ci) {
          auto& ch = s.chunks[ci];
          ch.reduced = ch.received[0].clone();
          for (int r = 1; r < s.ctx->d; ++r) ch.reduced.add_(ch.received[r]);
          ch.received.assign(s.ctx->d, torch::Tensor());
          self->send(s.wiring->coordinator,
                     grad_norm_partial{s.step, ci * s.ctx->p + s.stage, s.rank, partial_sq_norm(ch.reduced, ch.norm_mask)});
        }
        ev.end_us = s.ctx->now_us();
        s.events.push_back(ev);
      },
      [=](const clip_factor_msg& msg) {
        if (!accept(msg.step)) return;
        torch::set_num_threads(1);
        auto& s = self->state;
        trace_event ev{"optimizer", 0, s.stage, -1, -1, s.step, s.ctx->now_us(), 0};
        for (int ci = 0; ci < s.ctx->v; ++ci) {
          auto& ch = s.chunks[ci];
          ch.opt.step(ch.reduced, s.lr, msg.factor);
          ch.reduced = torch::Tensor();
          // All-gather: every replica of this stage receives the updated range.
          for (int r = 0; r < s.ctx->d; ++r)
            self->send(s.wiring->stages[r][s.stage], param_shard{s.step, ci, s.rank, make_payload(ch.opt.params())});
        }
        ev.end_us = s.ctx->now_us();
        s.events.push_back(ev);
        self->send(s.wiring->coordinator, shard_done{s.step, s.stage, s.rank, std::move(s.events)});
        s.events.clear();
      },
      [=](const reset_step&) -> reset_report { return drop_step_state(); },
      [=](state_atom) -> state_reply {  // AdamW moments by parameter name (checkpoints)
        named_moments moments;
        for (const auto& ch : self->state.chunks) gather_moments(ch.entries, ch.range, ch.opt, moments);
        state_reply rep;
        for (auto* m : {&moments.exp_avg, &moments.exp_avg_sq})
          for (auto& [name, t] : *m) {
            rep.names.push_back((m == &moments.exp_avg ? "exp_avg." : "exp_avg_sq.") + name);
            rep.tensors.push_back(make_payload(t));
          }
        return rep;
      },
      [=](const abort_step& msg) {
        drop_step_state();
        self->state.step = msg.step;
      },
  };
}

}  // namespace

caf::actor spawn_optimizer_shard_actor(caf::event_based_actor* supervisor, std::shared_ptr<const runtime_context> ctx,
                                       std::shared_ptr<const job_wiring> wiring, int stage, int rank) {
  return supervisor->spawn<caf::monitored>(shard_behavior, std::move(ctx), std::move(wiring), stage, rank);
}

}  // namespace troupe
