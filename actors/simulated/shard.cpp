// A simulated optimizer shard (actors/simulated/simulated.hpp): the real shard's messages,
// its collectives met in a sim_collective and waited for their modelled time.
#include <caf/all.hpp>

#include "actors/simulated/simulated.hpp"
#include "actors/wait_graph.hpp"
#include "messages/type_ids.hpp"

namespace troupe {

namespace {

// What a collective_done of a simulated shard ends (its `kind`).
enum sim_phase : std::int32_t { reduce_scatter = 0, update = 1, all_gather = 2 };

struct sim_shard_state {
  std::shared_ptr<const runtime_context> ctx;
  std::shared_ptr<const job_wiring> wiring;
  std::shared_ptr<sim_collective> group;  // the shards of this stage and tensor-parallel rank
  int stage = 0, rank = 0;
  std::string name;
  // --- per step ---
  std::int64_t step = -1;
  bool running = false;
  std::vector<int> buckets;  // per chunk: buckets received
  int reduced = 0;           // chunks reduce-scattered
  bool clipped = false;
  std::int64_t waiting_call = -1;  // the collective it is in (-1: none)
  std::string waiting_what;
  std::vector<trace_event> events;
  std::vector<caf::message> stash;
  bool copied_start = false;  // the buddy has the state it started from
};

using sim_shard_self = shard_actor::stateful_pointer<sim_shard_state>;

/// Call numbers of a step's collectives: unique per step, generation and chunk.
std::int64_t call_of(const sim_shard_state& s, sim_phase phase, int chunk) {
  return ((s.step * 256 + (s.wiring->generation & 255)) * 4 + phase) * 1024 + chunk;
}

void trace(sim_shard_self self, const char* name, int chunk, double start_us) {
  auto& s = self->state;
  trace_event ev;
  ev.name = name;
  ev.replica = s.rank;
  ev.stage = -1;
  ev.chunk = chunk;
  ev.step = s.step;
  ev.start_us = start_us;
  ev.end_us = s.ctx->now_us();
  s.events.push_back(std::move(ev));
}

/// Arrives at collective `phase` of `chunk`; the last member to arrive starts every
/// member's modelled wait (`seconds`), which ends in collective_done.
void meet(sim_shard_self self, sim_phase phase, int chunk, double seconds) {
  auto& s = self->state;
  const auto call = call_of(s, phase, chunk);
  s.waiting_call = call;
  s.waiting_what = std::string(phase == reduce_scatter ? "reduce-scatter" : "all-gather") + " of chunk " +
                   std::to_string(chunk);
  std::vector<int> all;
  if (!s.group->arrive(call, s.ctx->dp_of(s.rank), all)) return;
  const int tp = s.ctx->tp_of(s.rank);
  for (int dp : all)
    self->delayed_send(s.wiring->shards[s.stage][dp * s.ctx->t + tp], s.ctx->simulated->wait(seconds),
                       collective_done{s.step, phase, chunk, 0, {}});
}

bool accept(sim_shard_self self, std::int64_t step) {
  auto& s = self->state;
  if (step == s.step && s.running) return true;
  if (step > s.step) s.stash.push_back(self->current_mailbox_element()->move_content_to_message());
  return false;
}

const plan::stage_costs& costs_of(const sim_shard_state& s, int chunk) {
  return s.ctx->simulated->model.chunks.at(std::size_t(s.ctx->virtual_stage(s.stage, chunk)));
}

/// Where a lost node can come back (several simulated nodes): the state before `before`
/// goes to the buddy node's supervisor (a copy without tensors: a simulated shard holds
/// none), then `then` runs, as a real shard reports its step done once its buddy holds
/// the copy. (The copy's transfer time is not modelled.)
template <class F>
void copy_to_buddy(sim_shard_self self, std::int64_t before, F then) {
  auto& s = self->state;
  if (!s.wiring->buddy) return then();
  shard_copy copy;
  copy.stage = s.stage;
  copy.rank = s.rank;
  copy.step = before;
  self->request(s.wiring->buddy, std::chrono::seconds(s.ctx->cfg.step_timeout), std::move(copy))
      .then([then](bool) { then(); },
            [self](caf::error& err) {
              auto& s = self->state;
              self->send(s.wiring->coordinator, runtime_failure{s.step, s.name,
                                                                "copy to its buddy node: " + self->system().render(err),
                                                                s.wiring->generation});
            });
}

void on_done(sim_shard_self self, const collective_done& msg) {
  auto& s = self->state;
  if (!accept(self, msg.step)) return;
  const auto& ctx = *s.ctx;
  s.waiting_call = -1;
  if (msg.kind == reduce_scatter) {
    trace(self, "reduce-scatter", msg.chunk,
          ctx.now_us() - double(ctx.simulated->wait(costs_of(s, msg.chunk).reduce_scatter_exposed).count()));
    ++s.reduced;
    // Each chunk's part of the norm: together a norm of 1.
    self->send(s.wiring->supervisor, grad_norm_partial{s.step, ctx.virtual_stage(s.stage, msg.chunk), s.rank,
                                                        1.0 / (double(ctx.n_virtual) * ctx.pipes)});
  } else if (msg.kind == update) {
    double seconds = 0;
    for (int c = 0; c < ctx.v; ++c) seconds += costs_of(s, c).all_gather_exposed;
    trace(self, "optimizer", -1, ctx.now_us());
    meet(self, all_gather, 0, seconds);  // every chunk's parameters in one call, one after another on the link
  } else {
    for (int c = 0; c < ctx.v; ++c) {
      tensor_payload sized;
      sized.dtype = std::int8_t(ctx.compute_dtype);
      sized.shape = {std::int64_t(costs_of(s, c).params)};
      self->send(s.wiring->stages[s.rank][s.stage], param_shard{s.step, c, s.rank, std::move(sized)});
    }
    s.group->forget_below(call_of(s, reduce_scatter, 0));
    copy_to_buddy(self, s.step + 1, [self] {
      auto& s = self->state;
      s.running = false;
      self->send(s.wiring->supervisor, shard_done{s.step, s.stage, s.rank, std::move(s.events)});
      s.events.clear();
    });
  }
}

shard_actor::behavior_type sim_shard_behavior(sim_shard_self self, std::shared_ptr<const runtime_context> ctx,
                                              std::shared_ptr<const job_wiring> wiring, int stage, int rank,
                                              std::shared_ptr<sim_groups> groups) {
  auto& st = self->state;
  st.ctx = ctx;
  st.wiring = wiring;
  st.stage = stage;
  st.rank = rank;
  st.name = ctx->shard_name(stage, rank);
  st.group = groups->by_group.at(std::size_t(stage * ctx->t + ctx->tp_of(rank)));
  self->set_exception_handler([](caf::scheduled_actor*, std::exception_ptr& eptr) { return error_from_exception(eptr); });
  return {
      [=](const begin_step& msg) {
        auto& s = self->state;
        s.step = msg.step;
        s.running = true;
        s.buckets.assign(std::size_t(s.ctx->v), 0);
        s.reduced = 0;
        s.clipped = false;
        s.waiting_call = -1;
        if (!s.copied_start) {  // a new or rebuilt shard: the buddy gets the state it starts from
          s.copied_start = true;
          copy_to_buddy(self, s.step, [] {});
        }
        auto stash = std::move(s.stash);
        s.stash.clear();
        for (auto& m : stash) caf::anon_send(caf::actor_cast<caf::actor>(self), std::move(m));
      },
      [=](grad_shard& msg) {
        auto& s = self->state;
        if (!accept(self, msg.step)) return;
        if (++s.buckets.at(std::size_t(msg.chunk)) == s.ctx->simulated->buckets_per_chunk)
          meet(self, reduce_scatter, msg.chunk, costs_of(s, msg.chunk).reduce_scatter_exposed);
      },
      [=](const collective_done& msg) { on_done(self, msg); },
      [=](const clip_factor_msg& msg) {
        auto& s = self->state;
        if (!accept(self, msg.step) || s.clipped) return;
        s.clipped = true;
        double seconds = 0;
        for (int c = 0; c < s.ctx->v; ++c) seconds += costs_of(s, c).optimizer;
        self->delayed_send(self, s.ctx->simulated->wait(seconds), collective_done{s.step, update, -1, 0, {}});
      },
      [=](state_atom) -> shard_moments { return {}; },
      [=](const write_checkpoint&) {  // (simulated runs refuse checkpoint folders)
        return stage_checkpoint{{}, "a simulated shard holds no state to write", {}, {}, 0};
      },
      [=](const reset_step&) -> reset_report {
        auto& s = self->state;
        reset_report rep;
        rep.actor = s.name;
        s.running = false;
        s.waiting_call = -1;
        s.events.clear();
        return rep;
      },
      [=](wait_atom, std::int64_t step) -> caf::result<wait_report> {
        auto& s = self->state;
        if (s.ctx->simulated->groups->silent(s.wiring->node))
          return self->make_response_promise<wait_report>();  // (its node silent: never answered)
        wait_report rep;
        rep.actor = s.name;
        rep.node = s.wiring->node;
        if (report_other_step(rep, s.step, step)) return rep;
        rep.state = "reduced " + std::to_string(s.reduced) + " of " + std::to_string(s.ctx->v) + " chunks (simulated)";
        if (!s.running) {
          rep.state += ", done";
          return rep;
        }
        if (s.waiting_call >= 0) {
          rep.waits_for = s.waiting_what;
          rep.collective = "shards of stage " + std::to_string(s.stage) + " #" + std::to_string(s.waiting_call);
          const int tp = s.ctx->tp_of(s.rank);
          for (int dp : s.group->missing(s.waiting_call)) rep.from.push_back(s.ctx->shard_name(s.stage, dp * s.ctx->t + tp));
          return rep;
        }
        if (s.reduced == s.ctx->v && !s.clipped) {
          rep.waits_for = "clip factor";
          rep.from = {"coordinator"};
          rep.keys = {message_key("clip factor", "coordinator", s.name)};
          return rep;
        }
        for (int c = 0; c < s.ctx->v; ++c)
          if (s.buckets[std::size_t(c)] < s.ctx->simulated->buckets_per_chunk) {
            const auto from = s.ctx->stage_name(s.rank, s.stage);
            rep.waits_for = "gradient bucket " + std::to_string(s.buckets[std::size_t(c)]) + " of chunk " + std::to_string(c);
            rep.from = {from};
            rep.keys = {message_key(rep.waits_for, from, s.name)};
            return rep;
          }
        rep.state += ", updating";
        return rep;
      },
      [=](const abort_step& msg) {
        auto& s = self->state;
        s.running = false;
        s.waiting_call = -1;
        s.step = msg.step;
      },
  };
}

}  // namespace

shard_actor spawn_simulated_shard(caf::local_actor* supervisor, std::shared_ptr<const runtime_context> ctx,
                                  std::shared_ptr<const job_wiring> wiring, int stage, int rank,
                                  std::shared_ptr<sim_groups> groups) {
  return supervisor->spawn<caf::monitored>(sim_shard_behavior, std::move(ctx), std::move(wiring), stage, rank,
                                           std::move(groups));
}

}  // namespace troupe
