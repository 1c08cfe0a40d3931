// A simulated stage (actors/simulated/simulated.hpp): the real stage's messages and
// order, each op a timer of its modelled length.
#include <cmath>
#include <set>

#include <caf/all.hpp>
#include <spdlog/spdlog.h>

#include "actors/simulated/simulated.hpp"
#include "actors/supervisor_actor.hpp"
#include "actors/wait_graph.hpp"
#include "messages/type_ids.hpp"

namespace troupe {

namespace {

using key = std::pair<int, int>;  // (micro-batch, chunk)

struct sim_stage_state {
  std::shared_ptr<const runtime_context> ctx;
  std::shared_ptr<const job_wiring> wiring;
  int replica = 0, stage = 0;
  std::string name;
  const std::vector<pipeline_op>* order = nullptr;
  std::vector<int> chunk_ops;  // per chunk: its ops in a step
  std::int64_t ticks = 0;      // ops started (each one's end is tick n)
  fault_injector faults;       // fault injection (tests): throw_at and freeze as a real stage's
  caf::actor_addr supervisor;  // its node's (faults.kill_node ends it: the node is lost)
  // faults.freeze_node: its node went silent (it starts no op); since when (the node's
  // first slot's stage: it ends the supervisor once the connection timeout has passed).
  bool frozen = false;
  std::chrono::steady_clock::time_point frozen_at{};
  // --- per step ---
  std::int64_t step = -1;
  std::int32_t attempt = 0;
  bool running = false;
  std::size_t next_op = 0;
  bool busy = false;            // an op's timer is running
  double op_start_us = 0;
  std::set<key> inputs, grads, forwarded, backwarded;
  std::set<int> targets;
  std::vector<int> chunk_left;
  std::vector<int> losses;      // micro-batches whose loss this stage computed
  int params_received = 0, in_flight = 0, peak_in_flight = 0;
  bool done_reported = false;
  std::vector<trace_event> events;
  std::vector<caf::message> stash;  // messages of a later step
  struct sent_t {
    bool activation;
    int mb, chunk, to;
  };
  std::vector<sent_t> sent;
};

using sim_stage_self = stage_actor::stateful_pointer<sim_stage_state>;

class sim_stage {
 public:
  explicit sim_stage(sim_stage_self self) : self_(self), s_(self->state), ctx_(*self->state.ctx) {}

  int virtual_of(int chunk) const { return ctx_.virtual_stage(s_.stage, chunk); }
  bool is_last(int chunk) const { return virtual_of(chunk) == ctx_.n_virtual - 1; }
  std::string owner_name(int x) const { return ctx_.stage_name(s_.replica, ctx_.place(x).first); }

  bool ready(const pipeline_op& op) const {
    const key k{op.mb, op.chunk};
    if (op.kind == op_kind::forward) return s_.inputs.count(k) && (!is_last(op.chunk) || s_.targets.count(op.mb));
    if (op.kind == op_kind::backward) return s_.forwarded.count(k) && (is_last(op.chunk) || s_.grads.count(k));
    return s_.backwarded.count(k) > 0;
  }

  double cost(const pipeline_op& op) const {
    return op_seconds(ctx_.simulated->model.chunks.at(std::size_t(virtual_of(op.chunk))), op);
  }

  /// Starts the next op of the order when its inputs are here and no op is running.
  void run_ready() {
    if (s_.frozen || !s_.running || s_.busy || s_.next_op >= s_.order->size()) return;
    const auto& op = (*s_.order)[s_.next_op];
    if (!ready(op)) return;
    double extra = 0;
    if (s_.next_op == 1) {  // (as a real stage: the faults of its second op)
      if (s_.faults.stage_throws(s_.replica, s_.stage, s_.step, s_.attempt, throw_point::in_step)) {
        spdlog::warn("fault injected: {} throws in step {} (index {})", s_.name, s_.step + 1, s_.step);
        throw std::runtime_error("injected fault: " + s_.name + " throws in step " + std::to_string(s_.step + 1));
      }
      if (const auto seconds = s_.faults.take_freeze(s_.replica, s_.stage, s_.step, s_.attempt)) {
        spdlog::warn("fault injected: {}'s op takes {} s more in step {} (index {})", s_.name, *seconds, s_.step + 1,
                     s_.step);
        extra = *seconds;  // (a timer: the scheduler's threads stay free)
      }
    }
    s_.busy = true;
    s_.op_start_us = ctx_.now_us();
    self_->delayed_send(self_, ctx_.simulated->wait(cost(op)) + std::chrono::microseconds(std::int64_t(extra * 1e6)),
                        run_atom_v, ++s_.ticks);
  }

  /// The running op's timer ran out: its outputs go where a real op's would.
  void op_end(std::int64_t tick) {
    if (!s_.busy || tick != s_.ticks) return;  // a timer of an op a reset dropped
    s_.busy = false;
    const auto op = (*s_.order)[s_.next_op++];
    const key k{op.mb, op.chunk};
    const int x = virtual_of(op.chunk);
    const auto& sim = *ctx_.simulated;
    tensor_payload sized;  // an activation or gradient: its dtype and shape, no data
    sized.dtype = std::int8_t(ctx_.compute_dtype);
    if (op.kind == op_kind::forward) {
      s_.inputs.erase(k);
      s_.forwarded.insert(k);
      s_.peak_in_flight = std::max(s_.peak_in_flight, ++s_.in_flight);
      if (is_last(op.chunk)) {
        s_.targets.erase(op.mb);
        s_.losses.push_back(op.mb);
      } else {
        const auto [to, chunk] = ctx_.place(x + 1);
        sized.shape = ctx_.activation_shape(x + 1);
        s_.sent.push_back({true, op.mb, op.chunk, to});
        self_->delayed_send(s_.wiring->stages[s_.replica][to], sim.wait(sim.model.transfer),
                            forward_activation{s_.step, op.mb, chunk, sized, {}});
      }
      if (x == 0 && op.mb + ctx_.ahead < ctx_.m) self_->send(s_.wiring->loaders[s_.replica], credit{s_.step, op.mb});
    } else if (op.kind == op_kind::backward) {
      s_.forwarded.erase(k);
      s_.grads.erase(k);
      if (op.split) s_.backwarded.insert(k);
      else --s_.in_flight;
      if (x > 0) {
        const auto [to, chunk] = ctx_.place(x - 1);
        sized.shape = ctx_.activation_shape(x);
        s_.sent.push_back({false, op.mb, op.chunk, to});
        self_->delayed_send(s_.wiring->stages[s_.replica][to], sim.wait(sim.model.transfer),
                            backward_grad{s_.step, op.mb, chunk, sized});
      }
    } else {
      s_.backwarded.erase(k);
      --s_.in_flight;
    }
    trace_event ev;
    ev.name = op_letter(op.kind);
    ev.replica = s_.replica;
    ev.stage = s_.stage;
    ev.mb = op.mb;
    ev.chunk = op.chunk;
    ev.step = s_.step;
    ev.start_us = s_.op_start_us;
    ev.end_us = ctx_.now_us();
    s_.events.push_back(std::move(ev));
    if (--s_.chunk_left.at(std::size_t(op.chunk)) == 0) send_buckets(op.chunk);
    if (s_.next_op == s_.order->size()) {
      report_losses();
      maybe_done();
    }
    run_ready();
  }

  /// A chunk's backwards are over: its gradient buckets to its shard (sizes only).
  void send_buckets(int chunk) {
    const auto& sim = *ctx_.simulated;
    const auto per = std::int64_t(std::ceil(sim.model.chunks.at(std::size_t(virtual_of(chunk))).params /
                                            double(sim.buckets_per_chunk)));
    for (std::int64_t b = 0; b < sim.buckets_per_chunk; ++b) {
      tensor_payload sized;
      sized.dtype = std::int8_t(torch::kFloat32);
      sized.shape = {per};
      self_->send(s_.wiring->shards[s_.stage][s_.replica],
                  grad_shard{s_.step, chunk, s_.replica, std::int32_t(b), std::move(sized)});
    }
  }

  /// Each micro-batch's loss: that of a uniform prediction over the vocabulary (a
  /// simulated model learns nothing); tensor-parallel rank 0 reports, as a real stage.
  void report_losses() {
    if (ctx_.tp_of(s_.replica) == 0)
      for (int mb : s_.losses)
        self_->send(s_.wiring->supervisor,
                    loss_report{s_.step, s_.replica, mb, std::log(double(ctx_.spec.decoder.vocab))});
    s_.losses.clear();
  }

  void maybe_done() {
    if (s_.done_reported || s_.next_op < s_.order->size() || s_.params_received < ctx_.v) return;
    s_.done_reported = true;
    s_.running = false;
    stage_done done;
    done.step = s_.step;
    done.replica = s_.replica;
    done.stage = s_.stage;
    done.peak_in_flight = s_.peak_in_flight;
    done.events = std::move(s_.events);
    s_.events.clear();
    self_->send(s_.wiring->supervisor, std::move(done));
  }

  /// faults.freeze_node: once its node has been silent for the connection timeout, the
  /// node is lost (its supervisor ends, with every actor of the node).
  void connection_timed_out() {
    if (!s_.frozen || s_.frozen_at == std::chrono::steady_clock::time_point{}) return;
    const auto silent = std::chrono::steady_clock::now() - s_.frozen_at;
    if (silent < simulated_connection_timeout) {  // (early: wait for the rest of it)
      self_->delayed_send(self_, std::chrono::duration_cast<std::chrono::milliseconds>(simulated_connection_timeout - silent) +
                                     std::chrono::milliseconds(1),
                          run_atom_v);
      return;
    }
    const auto seconds = std::chrono::duration<double>(simulated_connection_timeout).count();
    spdlog::warn("simulated node {}: silent for {:.0f} s, its connection timed out: the node is lost", s_.wiring->node,
                 seconds);
    self_->send_exit(s_.supervisor,
                     caf::make_error(caf::sec::runtime_error,
                                     "simulated node " + std::to_string(s_.wiring->node) + " silent for " +
                                         fmt::format("{:.0f}", seconds) +
                                         " s: its connection timed out (faults.freeze_node)"));
  }

  /// Whether a message of `step` is taken now (a later one's waits for its begin_step).
  bool accept(std::int64_t step) {
    if (step == s_.step && s_.running) return true;
    if (step > s_.step) s_.stash.push_back(self_->current_mailbox_element()->move_content_to_message());
    return false;
  }

  void begin(const begin_step& msg) {
    // A lost node (faults.kill_node): its first slot's stage ends its supervisor, which
    // takes every actor of the node with it, as a killed node process does.
    if (s_.faults.kills_node(s_.wiring->node, msg.step, msg.attempt) &&
        job_slots(ctx_.cfg, s_.wiring->node, ctx_.cfg.simulated_nodes).front() == std::make_pair(s_.replica, s_.stage)) {
      spdlog::warn("fault injected: simulated node {} is lost as step {} (index {}) begins", s_.wiring->node,
                   msg.step + 1, msg.step);
      self_->send_exit(s_.supervisor, caf::make_error(caf::sec::runtime_error, std::string("simulated node lost (faults.kill_node)")));
    }
    // A silent node (faults.freeze_node: frozen, or cut off from the others): its stages
    // start no op from now on, and nothing of it reaches the job. A node process's peers
    // notice only when its connection times out; then it is lost as a killed one is.
    if (s_.faults.freezes_node(s_.wiring->node, msg.step, msg.attempt)) {
      s_.frozen = true;
      if (job_slots(ctx_.cfg, s_.wiring->node, ctx_.cfg.simulated_nodes).front() == std::make_pair(s_.replica, s_.stage)) {
        spdlog::warn("fault injected: simulated node {} goes silent as step {} (index {}) begins", s_.wiring->node,
                     msg.step + 1, msg.step);
        s_.frozen_at = std::chrono::steady_clock::now();
        self_->delayed_send(self_, simulated_connection_timeout, run_atom_v);
      }
    }
    s_.step = msg.step;
    s_.attempt = msg.attempt;
    s_.running = true;
    s_.next_op = 0;
    s_.busy = false;
    s_.chunk_left = s_.chunk_ops;
    s_.params_received = s_.in_flight = s_.peak_in_flight = 0;
    s_.done_reported = false;
    s_.sent.clear();
    auto stash = std::move(s_.stash);
    s_.stash.clear();
    for (auto& m : stash) caf::anon_send(caf::actor_cast<caf::actor>(self_), std::move(m));
    run_ready();
  }

  reset_report reset() {
    reset_report rep;
    rep.actor = s_.name;
    auto held = [&](const char* what, std::size_t n) {
      if (n > 0) rep.leftovers.push_back(std::to_string(n) + " " + what);
    };
    held("inputs", s_.inputs.size());
    held("gradients", s_.grads.size());
    held("forwards without backward", s_.forwarded.size());
    held("targets", s_.targets.size());
    s_.inputs.clear();
    s_.grads.clear();
    s_.forwarded.clear();
    s_.backwarded.clear();
    s_.targets.clear();
    s_.losses.clear();
    s_.events.clear();
    s_.running = s_.busy = false;
    return rep;
  }

  wait_report waits(std::int64_t step) const {
    wait_report rep;
    rep.actor = s_.name;
    rep.node = s_.wiring->node;
    if (s_.step == step)
      for (const auto& m : s_.sent)
        rep.sent.push_back(message_key(
            (m.activation ? "activation mb " : "gradient mb ") + std::to_string(m.mb) + " chunk " +
                std::to_string(ctx_.place(virtual_of(m.chunk) + (m.activation ? 1 : -1)).second),
            s_.name, ctx_.stage_name(s_.replica, m.to)));
    auto wait = [&](std::string what, const std::string& from) {
      rep.keys = {message_key(what, from, s_.name)};
      rep.waits_for = std::move(what);
      rep.from = {from};
    };
    if (report_other_step(rep, s_.step, step)) return rep;
    rep.state = "ran " + std::to_string(s_.next_op) + " of " + std::to_string(s_.order->size()) + " simulated ops";
    if (s_.frozen) {
      rep.state += ", its node silent (faults.freeze_node)";
      return rep;
    }
    if (s_.busy) {
      rep.state += ", computing";
      return rep;
    }
    if (s_.next_op < s_.order->size()) {
      const auto& op = (*s_.order)[s_.next_op];
      const int x = virtual_of(op.chunk);
      const auto mb = std::to_string(op.mb), chunk = std::to_string(op.chunk);
      if (op.kind == op_kind::backward)
        wait("gradient mb " + mb + " chunk " + chunk, owner_name(x + 1));
      else if (op.kind == op_kind::weight || ready(op))
        rep.state += ", runnable";
      else if (s_.inputs.count({op.mb, op.chunk}))
        wait("target mb " + mb, ctx_.loader_name(s_.replica));
      else if (x == 0)
        wait("input mb " + mb, ctx_.loader_name(s_.replica));
      else
        wait("activation mb " + mb + " chunk " + chunk, owner_name(x - 1));
      return rep;
    }
    if (!s_.done_reported) {
      wait("parameters of chunk " + std::to_string(s_.params_received), ctx_.shard_name(s_.stage, s_.replica));
      return rep;
    }
    rep.state += ", done";
    return rep;
  }

 private:
  sim_stage_self self_;
  sim_stage_state& s_;
  const runtime_context& ctx_;
};

stage_actor::behavior_type sim_stage_behavior(sim_stage_self self, std::shared_ptr<const runtime_context> ctx,
                                              std::shared_ptr<const job_wiring> wiring, int replica, int stage,
                                              caf::actor_addr supervisor) {
  auto& st = self->state;
  st.supervisor = std::move(supervisor);
  st.ctx = ctx;
  st.wiring = wiring;
  st.replica = replica;
  st.stage = stage;
  st.name = ctx->stage_name(replica, stage);
  st.order = &ctx->sched.ranks.at(std::size_t(stage));
  st.faults = fault_injector(ctx->faults);
  st.chunk_ops.assign(std::size_t(ctx->v), 0);
  for (const auto& op : *st.order) ++st.chunk_ops.at(std::size_t(op.chunk));
  self->set_exception_handler([](caf::scheduled_actor*, std::exception_ptr& eptr) { return error_from_exception(eptr); });
  auto logic = std::make_shared<sim_stage>(self);
  auto refuse = [self](const char* what) {
    self->send(self->state.wiring->coordinator,
               runtime_failure{self->state.step, self->state.name, std::string(what) + ": not in a simulated run",
                               self->state.wiring->generation});
  };
  return {
      [=](const begin_step& msg) { logic->begin(msg); },
      [=](microbatch_input& msg) {
        if (!logic->accept(msg.step)) return;
        self->state.inputs.insert({msg.mb, 0});
        logic->run_ready();
      },
      [=](microbatch_target& msg) {
        if (!logic->accept(msg.step)) return;
        self->state.targets.insert(msg.mb);
        logic->run_ready();
      },
      [=](forward_activation& msg) {
        if (!logic->accept(msg.step)) return;
        self->state.inputs.insert({msg.mb, msg.chunk});
        logic->run_ready();
      },
      [=](backward_grad& msg) {
        if (!logic->accept(msg.step)) return;
        self->state.grads.insert({msg.mb, msg.chunk});
        logic->run_ready();
      },
      [=](tied_grad&) {},  // (a simulated model ties nothing)
      [=](param_shard& msg) {
        if (!logic->accept(msg.step)) return;
        ++self->state.params_received;
        logic->maybe_done();
      },
      [=](eval_activation&) { refuse("evaluation"); },
      [=](const eval_target&) {},
      [=](eval_atom, std::int64_t) -> std::vector<trace_event> { return {}; },
      [=](run_atom) { logic->connection_timed_out(); },
      [=](run_atom, std::int64_t tick) { logic->op_end(tick); },
      [=](const reset_step&) -> reset_report { return logic->reset(); },
      [=](wait_atom, std::int64_t step) -> caf::result<wait_report> {
        if (self->state.frozen) return self->make_response_promise<wait_report>();  // (silent: never answered)
        return logic->waits(step);
      },
      [=](const abort_step& msg) {
        logic->reset();
        self->state.step = msg.step;
      },
      [=](state_atom) -> state_reply { return {}; },
      [=](const write_checkpoint&) -> stage_checkpoint {
        stage_checkpoint rep;
        rep.error = "a simulated stage holds no parameters to write";
        return rep;
      },
      [=](plant_atom) { self->state.inputs.insert({-1, -1}); },
  };
}

}  // namespace

stage_actor spawn_simulated_stage(caf::local_actor* supervisor, std::shared_ptr<const runtime_context> ctx,
                                  std::shared_ptr<const job_wiring> wiring, int replica, int stage) {
  // Event-based (no thread of its own): its ops are timers.
  return supervisor->spawn<caf::monitored>(sim_stage_behavior, std::move(ctx), std::move(wiring), replica, stage,
                                           supervisor->address());
}

}  // namespace troupe
