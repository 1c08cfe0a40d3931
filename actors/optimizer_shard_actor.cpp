#include "actors/optimizer_shard_actor.hpp"

#include <caf/all.hpp>
#include <torch/torch.h>

#include "actors/checkpoint_writer.hpp"
#include "actors/snapshot.hpp"
#include "compute/checkpoint/checkpoint_dir.hpp"
#include "compute/optim/grad_buffer.hpp"
#include "compute/optim/optimizer.hpp"
#include "compute/parallel/tensor_parallel.hpp"
#include "compute/models/tensor_parallel_layout.hpp"
#include "messages/type_ids.hpp"
#include "transport/transport.hpp"

namespace troupe {

namespace {

using transport::collective;

/// Where a shard is in a step (its answer to the hang probe follows from it).
enum class shard_phase {
  between_steps,   ///< before the step's begin_step, or after reporting it done
  collecting,      ///< receiving the stage's gradient buckets (reduce-scatters start as they come)
  stalled,         ///< fault injection: holds every bucket, starts no reduce-scatter
  reducing,        ///< every reduce-scatter started, not all finished
  awaiting_clip,   ///< its gradient-norm partials sent: waits for the coordinator's clip factor
  gathering,       ///< updated; the all-gather of the parameters runs
  copying,         ///< all-gathered; waits for the buddy node to acknowledge its copy
};

struct shard_state {
  struct chunk_shard {
    std::vector<flat_range> buckets;  // the chunk's gradient buckets (slice_buckets)
    shard_groups groups;       // the groups its regions are reduced over (dense, experts)
    shard_layout layout;       // this rank's piece of each bucket (its shard: their concatenation)
    std::vector<std::int64_t> at;  // where each bucket's piece begins in the shard
    adamw_shard opt;
    shard_mask norm_mask;  ///< the elements the gradient norm counts
    torch::Tensor grads;       // the stage's whole grad buffer of this step (hand-off)
    std::vector<char> here;    // per bucket: final, handed over this step
    torch::Tensor reduced;     // this rank's shard of the summed gradients
    torch::Tensor gathered;    // the whole updated parameter buffer (all-gather target; in
                               // the compute dtype: bf16 jobs gather bf16, half the bytes)
    torch::Tensor rounded;     // bf16 jobs: this rank's main parameters rounded (all-gather input)
    std::vector<param_entry> entries;  // the chunk's layout (names and offsets)
    std::int64_t numel = 0;            // the chunk's whole buffer's elements
    std::vector<double> start_us;      // each bucket's reduce-scatter
  };
  std::shared_ptr<const runtime_context> ctx;
  std::shared_ptr<const job_wiring> wiring;
  std::shared_ptr<transport::communicator> comm;
  /// Expert parallelism: the expert-data-parallel group (the shards of the pipelines
  /// holding the same experts), over which the chunks' expert regions are reduced.
  std::shared_ptr<transport::communicator> expert_comm;
  std::shared_ptr<snapshot_store> store;
  int stage = 0, rank = 0;  // rank: the pipeline (dp t + tp) whose stage it updates
  std::string name;
  std::vector<chunk_shard> chunks;
  std::int64_t step = -1;
  std::int32_t attempt = 0;
  double lr = 0;
  fault_injector faults;     // fault injection (tests): this actor's own
  int received = 0;          // buckets handed over this step
  std::size_t reduce_scatters = 0;  // reduce-scatters started this step (an index into `order`)
  std::size_t completed = 0; // collectives of the current phase that finished
  // The (chunk, bucket) reduce-scatters in the order every rank starts them: the last
  // chunk first and in a chunk the last bucket first (the order the backwards finish
  // them in). The collectives of a communicator pair up in the order they start, and the
  // order buckets arrive in may differ between replicas.
  std::vector<std::pair<int, int>> order;
  std::vector<transport::work_ptr> pending;
  double phase_start_us = 0;
  std::vector<trace_event> events;
  std::vector<caf::message> stash;
  // Buddy copies (several nodes, node > 0): the step of the newest copy sent, copies not
  // yet acknowledged, and whether this step's all-gather finished: shard_done waits for
  // both, so a committed step always has the state before the next one on the buddy.
  std::int64_t copied = -1;
  int copies_pending = 0;
  bool gathered = false;
  shard_phase phase = shard_phase::between_steps;
  std::vector<std::string> sent;  ///< message_key of what it sent this step (wait-for graph)

  std::string stage_actor_name() const { return ctx->stage_name(rank, stage); }
  /// The communicator bucket `b` of chunk `ch` is reduced and gathered over.
  transport::communicator& comm_of(const chunk_shard& ch, int b) const {
    return ch.groups.in_experts(ch.buckets[std::size_t(b)]) ? *expert_comm : *comm;
  }
  void record_sent(const std::string& what, const std::string& to) { sent.push_back(message_key(what, name, to)); }
};

/// What shard `s` waits for in `step`, from whom, and what it sent.
wait_report shard_waits(const shard_state& s, std::int64_t step) {
  wait_report rep;
  rep.actor = s.name;
  rep.node = s.wiring->node;
  if (s.step != step) {
    rep.state = s.step < step ? "still at step " + std::to_string(s.step + 1) : "already at step " + std::to_string(s.step + 1);
    if (s.step < step) {
      rep.waits_for = "begin of step " + std::to_string(step + 1);
      rep.from = {"coordinator"};
      rep.keys = {message_key(rep.waits_for, "coordinator", s.name)};
    }
    return rep;
  }
  rep.sent = s.sent;
  std::vector<std::string> peers;  // the other shards of the stage's data-parallel group
  for (int r = s.ctx->tp_of(s.rank); r < s.ctx->pipes; r += s.ctx->t)
    if (r != s.rank) peers.push_back(s.ctx->shard_name(s.stage, r));
  if (s.expert_comm)  // and of its expert-data-parallel group
    for (int r = s.rank % s.ctx->ep; r < s.ctx->pipes; r += s.ctx->ep)
      if (r != s.rank && r % s.ctx->t != s.rank % s.ctx->t) peers.push_back(s.ctx->shard_name(s.stage, r));
  switch (s.phase) {
    case shard_phase::between_steps:
      rep.state = "done with the step";
      break;
    case shard_phase::collecting:
      rep.state = "has " + std::to_string(s.received) + " of " + std::to_string(s.order.size()) + " gradient buckets";
      for (const auto& [ci, b] : s.order)
        if (!s.chunks[ci].here[b]) {
          rep.waits_for = s.ctx->shards_grads() ? "reduced gradients of chunk " + std::to_string(ci)
                                                : "gradient bucket " + std::to_string(b) + " of chunk " + std::to_string(ci);
          rep.from = {s.stage_actor_name()};
          rep.keys = {message_key(rep.waits_for, s.stage_actor_name(), s.name)};
          break;
        }
      break;
    case shard_phase::stalled:
      rep.state = "holds every gradient bucket and started no reduce-scatter (injected stall)";
      break;
    case shard_phase::reducing:
      rep.state = std::to_string(s.completed) + " of " + std::to_string(s.order.size()) + " reduce-scatters done";
      rep.waits_for = "the reduce-scatter of its gradients";
      rep.from = peers;
      break;
    case shard_phase::awaiting_clip:
      rep.state = "gradients reduced, gradient-norm partials sent";
      rep.waits_for = "the clip factor";
      rep.from = {"coordinator"};
      rep.keys = {message_key(rep.waits_for, "coordinator", s.name)};
      break;
    case shard_phase::gathering:
      rep.state = "updated; " + std::to_string(s.completed) + " of " + std::to_string(s.order.size()) + " all-gathers done";
      rep.waits_for = "the all-gather of the updated parameters";
      rep.from = peers;
      break;
    case shard_phase::copying:
      rep.state = "all-gathered";
      rep.waits_for = "the acknowledgement of its optimizer state copy";
      rep.from = {"supervisor of node " + std::to_string(s.wiring->buddy_node)};
      break;
  }
  return rep;
}

/// Keeps the shard's state before step `step` in the node's snapshot store (shared with
/// the double-buffered optimizer state, not copied: see snapshot.hpp).
void take_snapshot(shard_state& s, std::int64_t step) {
  auto snap = std::make_shared<shard_snapshot>();
  snap->step = step;
  for (const auto& ch : s.chunks) {
    snap->chunks.push_back(ch.opt.current());
    snap->stage_numel.push_back(ch.numel);
    snap->stage_expert_offset.push_back(std::min(ch.groups.expert_offset, ch.numel));
  }
  s.store->put(s.stage, s.rank, std::move(snap));
}

using shard_self = shard_actor::stateful_pointer<shard_state>;

/// Lays out the shard's chunks (its piece of each gradient bucket, over the bucket's
/// group) and their optimizer state: the initial parameters, a resumed checkpoint's
/// moments, or (`from`: restarted in place) the state before the step being retried.
void init_chunks(shard_state& st, const std::shared_ptr<const shard_snapshot>& from) {
  const auto& ctx = st.ctx;
  const adamw_options opts{ctx->cfg.beta1, ctx->cfg.beta2, ctx->cfg.eps, ctx->cfg.weight_decay};
  const tensor_parallel tp{ctx->tp_of(st.rank), ctx->t, ctx->sequence_parallel, nullptr};  // (the layout of its part)
  // (The initial parameters' values only for a shard that starts with the job: one made
  // later starts from `from`.)
  const auto init = ctx->take_init();
  if (!from && !init.empty() && init.front().second.is_meta())
    throw std::logic_error(st.name + " made after the job's start without a snapshot of its state");
  for (int c = 0; c < ctx->v; ++c) {
    // A slice only to learn the layout and initial values of this range; dropped at once.
    auto layout = make_slice(ctx->spec, ctx->ranges[ctx->virtual_stage(st.stage, c)], init, ctx->d, ctx->device,
                             torch::kFloat32, tp, ctx->experts_of(st.rank));
    const auto n = layout->flat_params().numel();
    st.chunks.emplace_back();
    auto& ch = st.chunks.back();
    ch.buckets = ctx->buckets_of(*layout);
    ch.groups = ctx->groups_of(st.rank, *layout);
    ch.layout = bucket_shard(ch.buckets, ch.groups);
    std::vector<torch::Tensor> mine;
    for (std::size_t b = 0; b < ch.buckets.size(); ++b) {
      const auto& piece = ch.layout[b];
      if (transport::piece(ch.buckets[b].size(), ch.groups.ranks_of(ch.buckets[b]), ch.groups.rank_of(ch.buckets[b])) !=
          std::make_pair(piece.begin - ch.buckets[b].begin, piece.end - ch.buckets[b].begin))
        throw std::logic_error("bucket pieces differ from the transport's pieces");
      ch.at.push_back(b == 0 ? 0 : ch.at.back() + ch.layout[b - 1].size());
      mine.push_back(layout->flat_params().narrow(0, piece.begin, piece.size()));
    }
    const auto size = shard_size(ch.layout);
    ch.opt = adamw_shard(torch::cat(mine), decay_mask(layout->entries(), ch.layout).to(ctx->device), opts,
                         /*double_buffered=*/true);
    ch.norm_mask = shard_mask(norm_mask(layout->entries(), ch.layout).to(ctx->device));
    ch.here.assign(ch.buckets.size(), 0);
    ch.reduced = torch::empty({size}, layout->flat_params().options());
    ch.numel = n;
    // (Parameters sharded: the stage gathers them from this shard's pieces, for each op.)
    if (!ctx->shards_params())
      ch.gathered = torch::empty({n}, layout->flat_params().options().dtype(ctx->compute_dtype));
    if (ctx->compute_dtype != torch::kFloat32)
      ch.rounded = torch::empty({size}, layout->flat_params().options().dtype(ctx->compute_dtype));
    ch.start_us.assign(ch.buckets.size(), 0.0);
    if (from) ch.opt.assign(from->chunks.at(c));  // restarted in place: the state before the step being retried
    ch.entries = layout->entries();
  }
  if (from) return;
  // Started with the job: a resumed checkpoint's moments, if any.
  ctx->with_resume_moments([&](const std::map<std::string, torch::Tensor>& moments) {
    if (moments.empty()) return;
    const std::map<std::string, torch::Tensor> init_by_name(init.begin(), init.end());
    if (ctx->t == 1) {
      for (auto& ch : st.chunks) restore_shard(ch.entries, ch.layout, ch.opt, init_by_name, moments, ctx->start_step);
      return;
    }
    // Tensor parallelism: this rank's parts of the whole checkpoint's tensors.
    const auto params = shard_by_name(ctx->spec, init_by_name, init_by_name, ctx->t, ctx->tp_of(st.rank));
    const auto mine = shard_by_name(ctx->spec, init_by_name, moments, ctx->t, ctx->tp_of(st.rank));
    for (auto& ch : st.chunks) restore_shard(ch.entries, ch.layout, ch.opt, params, mine, ctx->start_step);
  });
}

/// Whether a message of `step` is for now; one of a later step waits in the stash.
bool accept(shard_self self, std::int64_t step) {
  if (step == self->state.step) return true;
  if (step > self->state.step) self->state.stash.push_back(self->current_mailbox_element()->move_content_to_message());
  return false;
}

/// Keeps `w`; its completion comes back to the shard as collective_done.
void report_to_self(shard_self self, transport::work_ptr w, collective kind, int ci, int bucket) {
  auto& s = self->state;
  w->on_complete([me = caf::actor_cast<shard_actor>(self), step = s.step, kind, ci, bucket](const std::string& err) {
    caf::anon_send(me, collective_done{step, std::int32_t(kind), ci, bucket, err});
  });
  s.pending.push_back(std::move(w));
}

/// Starts the reduce-scatters of the buckets handed over, in `order` (the stage hands a
/// bucket over as soon as the step's last backward has produced it, while that backward
/// and the other chunks' go on).
void start_reduce_scatters(shard_self self) {
  auto& s = self->state;
  while (s.reduce_scatters < s.order.size()) {
    const auto [ci, b] = s.order[s.reduce_scatters];
    auto& ch = s.chunks[ci];
    if (!ch.here[b]) return;
    if (s.reduce_scatters++ == 0) s.completed = 0;
    ch.start_us[b] = s.ctx->now_us();
    const auto& bucket = ch.buckets[b];
    report_to_self(self,
                   s.comm_of(ch, b).reduce_scatter(ch.grads.narrow(0, bucket.begin, bucket.size()),
                                                   ch.reduced.narrow(0, ch.at[b], ch.layout[b].size())),
                   collective::reduce_scatter, ci, b);
    if (s.reduce_scatters == s.order.size()) s.phase = shard_phase::reducing;
  }
}

/// Starts every bucket's all-gather.
void start_all_gathers(shard_self self) {
  auto& s = self->state;
  s.completed = 0;
  s.phase = shard_phase::gathering;
  s.phase_start_us = s.ctx->now_us();
  for (auto& ch : s.chunks)
    if (ch.rounded.defined()) ch.rounded.copy_(ch.opt.params());
  for (const auto& [ci, b] : s.order) {
    auto& ch = s.chunks[ci];
    const auto& mine = ch.rounded.defined() ? ch.rounded : ch.opt.params();
    const auto& bucket = ch.buckets[b];
    report_to_self(self,
                   s.comm_of(ch, b).all_gather(mine.narrow(0, ch.at[b], ch.layout[b].size()),
                                               ch.gathered.narrow(0, bucket.begin, bucket.size())),
                   collective::all_gather, ci, b);
  }
}

void maybe_done(shard_self self);

/// Parameters sharded (ZeRO-3): the stage gets this shard's updated pieces (bf16 jobs:
/// rounded), from which its ops gather the chunk; no all-gather here.
void send_pieces(shard_self self) {
  auto& s = self->state;
  for (int ci = 0; ci < s.ctx->v; ++ci) {
    auto& ch = s.chunks[ci];
    if (ch.rounded.defined()) ch.rounded.copy_(ch.opt.params());
    s.record_sent("parameters of chunk " + std::to_string(ci), s.stage_actor_name());
    self->send(s.wiring->stages[s.rank][s.stage],
               param_shard{s.step, ci, s.rank, make_payload(ch.rounded.defined() ? ch.rounded : ch.opt.params())});
  }
  s.gathered = true;
  maybe_done(self);
}

/// Reports the step done once its all-gather finished and the buddy holds its copies.
void maybe_done(shard_self self) {
  auto& s = self->state;
  if (!s.gathered) return;
  if (s.copies_pending > 0) {
    s.phase = shard_phase::copying;
    return;
  }
  s.gathered = false;
  s.phase = shard_phase::between_steps;
  s.record_sent("shard done", "coordinator");
  self->send(s.wiring->supervisor, shard_done{s.step, s.stage, s.rank, std::move(s.events)});
  s.events.clear();
}

/// Sends the state before step `before` (in the store) to the buddy's supervisor.
void send_copy(shard_self self, std::int64_t before) {
  auto& s = self->state;
  const auto snap = s.store->get(s.stage, s.rank, before);
  if (!s.wiring->buddy || !snap) return;
  s.copied = before;
  ++s.copies_pending;
  const double t0 = s.ctx->now_us();
  // The tensors go over the nodes' world communicator (UCX), the message carries their
  // handles; they stay untouched until acknowledged (double-buffered: see snapshot.hpp).
  auto copy = copy_of(s.stage, s.rank, *snap);
  std::int64_t bytes = 0;
  for (auto* v : {&copy.params, &copy.exp_avg, &copy.exp_avg_sq})
    for (auto& p : *v) {
      bytes += payload_bytes(p);
      p = ship_payload(*s.wiring, p, s.wiring->buddy_node, s.name);
    }
  self->request(s.wiring->buddy, std::chrono::seconds(s.ctx->cfg.step_timeout), std::move(copy))
      .then(
          [self, step = s.step, t0, bytes](bool) {
            auto& s = self->state;
            if (step != s.step) return;
            s.events.push_back({"buddy-copy", s.rank, s.stage, -1, -1, s.step, t0, s.ctx->now_us(), bytes});
            --s.copies_pending;
            maybe_done(self);
          },
          [self, step = s.step](caf::error& err) {
            auto& s = self->state;
            if (step != s.step) return;
            self->send(s.wiring->coordinator,
                       runtime_failure{s.step, s.name, "copy to its buddy node: " + self->system().render(err),
                                       s.wiring->generation});
          });
}

/// Drops the step's state (a reset or an abort): what was still held is the reset's report.
reset_report drop_step_state(shard_self self) {
  auto& s = self->state;
  reset_report rep{s.name, {}};
  int held = 0;
  for (auto& c : s.chunks) {
    held += c.grads.defined();
    c.grads = torch::Tensor();
    std::fill(c.here.begin(), c.here.end(), 0);
  }
  if (held) rep.leftovers.push_back(std::to_string(held) + " gradient buffer(s) held");
  std::size_t running = 0;
  for (auto& w : s.pending) running += !w->done();
  if (running) {
    rep.leftovers.push_back(std::to_string(running) + " collective(s) still running");
    s.comm->abort(s.name + " reset with collectives running");
    if (s.expert_comm) s.expert_comm->abort(s.name + " reset with collectives running");
  }
  s.pending.clear();
  if (!s.stash.empty()) rep.leftovers.push_back(std::to_string(s.stash.size()) + " stashed message(s)");
  s.stash.clear();
  s.received = 0;
  s.reduce_scatters = 0;
  s.events.clear();
  s.phase = shard_phase::between_steps;
  return rep;
}

void on_begin_step(shard_self self, const begin_step& msg) {
  auto& s = self->state;
  s.step = msg.step;
  s.attempt = msg.attempt;
  s.lr = msg.lr;
  s.received = 0;
  s.reduce_scatters = 0;
  s.gathered = false;
  s.phase = shard_phase::collecting;
  s.sent.clear();
  // The step before this one is committed: its state before it (the other half of the
  // double buffer, and its snapshot) goes until this step's update needs a bank again.
  // Between steps the shard holds one copy of its state.
  s.store->drop_before(s.stage, s.rank, s.step);
  for (auto& ch : s.chunks) ch.opt.release_previous();
  // A new or rebuilt shard: the buddy gets the state it starts from.
  if (s.copied < s.step) send_copy(self, s.step);
  auto stash = std::move(s.stash);
  s.stash.clear();
  for (auto& m : stash) caf::anon_send(caf::actor_cast<caf::actor>(self), std::move(m));  // in order, as they came
}

/// The gradient-norm partials of every chunk's reduced gradients go to the coordinator,
/// which answers with the clip factor.
void send_norm_partials(shard_self self) {
  auto& s = self->state;
  for (int ci = 0; ci < s.ctx->v; ++ci) {
    auto& ch = s.chunks[ci];
    ch.grads = torch::Tensor();  // the stage's buffer is no longer read
    std::fill(ch.here.begin(), ch.here.end(), 0);
    s.record_sent("gradient-norm partial of chunk " + std::to_string(ci), "coordinator");
    // Hybrid sharding: every piece has d / g copies, one of which counts.
    const double partial = s.ctx->shard_copy_of(s.rank) == 0 ? partial_sq_norm(ch.reduced, ch.norm_mask) : 0.0;
    self->send(s.wiring->supervisor,
               grad_norm_partial{s.step, s.ctx->virtual_stage(s.stage, ci), s.rank, partial});
  }
  s.phase = shard_phase::awaiting_clip;
}

/// Gradients sharded (FSDP): a chunk's gradients, reduce-scattered by its stage after
/// each backward, this shard's pieces summed over the step (bucket -1: all at once).
void on_reduced_grads(shard_self self, grad_shard& msg) {
  auto& s = self->state;
  auto& c = s.chunks.at(msg.chunk);
  auto fail = [&](const std::string& why) {
    self->send(s.wiring->coordinator, runtime_failure{s.step, s.name, why, s.wiring->generation});
  };
  const auto problem = check_payload(msg.data, {c.reduced.numel()}, torch::kFloat32);
  if (!problem.empty()) return fail("reduced gradients: " + problem);
  if (msg.bucket != -1 || c.here.at(0)) return fail("reduced gradients of chunk " + std::to_string(msg.chunk) +
                                                    ": not all buckets at once, or handed over twice");
  c.reduced.copy_(tensor_of(msg.data));  // (the stage's accumulator is zeroed for its next step)
  std::fill(c.here.begin(), c.here.end(), 1);
  s.received += int(c.buckets.size());
  if (s.faults.shard_stalls(s.stage, s.rank, s.step, s.attempt)) {
    if (s.received == int(s.order.size())) {
      s.phase = shard_phase::stalled;
      spdlog::warn("fault injected: {} stalls: no update in step {} (index {})", s.name, s.step + 1, s.step);
    }
    return;
  }
  if (s.received == int(s.order.size())) send_norm_partials(self);
}

/// A bucket of the stage's gradients, final: its reduce-scatter starts in its turn.
void on_grad_shard(shard_self self, grad_shard& msg) {
  if (!accept(self, msg.step)) return;
  auto& s = self->state;
  auto& c = s.chunks.at(msg.chunk);
  if (s.ctx->shards_grads()) return on_reduced_grads(self, msg);
  const auto problem = check_payload(msg.data, {c.numel}, torch::kFloat32);
  if (!problem.empty()) {
    self->send(s.wiring->coordinator, runtime_failure{s.step, s.name, "gradient buffer: " + problem, s.wiring->generation});
    return;
  }
  if (msg.bucket < 0 || std::size_t(msg.bucket) >= c.buckets.size() || c.here[msg.bucket]) {
    self->send(s.wiring->coordinator,
               runtime_failure{s.step, s.name,
                               "gradient bucket " + std::to_string(msg.bucket) + " of chunk " +
                                   std::to_string(msg.chunk) + ": unknown or handed over twice",
                               s.wiring->generation});
    return;
  }
  c.grads = tensor_of(msg.data);
  c.here[msg.bucket] = 1;
  if (s.faults.shard_stalls(s.stage, s.rank, s.step, s.attempt)) {
    if (++s.received == int(s.order.size())) {
      s.phase = shard_phase::stalled;
      spdlog::warn("fault injected: {} stalls: no reduce-scatter in step {} (index {})", s.name, s.step + 1, s.step);
    }
    return;
  }
  ++s.received;
  start_reduce_scatters(self);
}

/// A reduce-scatter or all-gather finished: after the last reduce-scatter the gradient
/// norm's partials go to the coordinator; after the last all-gather the parameters go to
/// the stage.
void on_collective_done(shard_self self, const collective_done& msg) {
  auto& s = self->state;
  if (msg.step != s.step) return;  // a collective of an aborted step
  if (!msg.error.empty()) {
    self->send(s.wiring->coordinator,
               runtime_failure{s.step, s.name,
                               std::string(transport::collective_name(collective(msg.kind))) + " of chunk " +
                                   std::to_string(msg.chunk) + " (bucket " + std::to_string(msg.bucket) +
                                   "): " + msg.error,
                               s.wiring->generation});
    return;
  }
  if (collective(msg.kind) == collective::reduce_scatter) {  // one event per bucket (its number as mb)
    const auto& ch = s.chunks.at(msg.chunk);
    s.events.push_back({"reduce-scatter", s.rank, s.stage, msg.bucket, msg.chunk, s.step, ch.start_us.at(msg.bucket),
                        s.ctx->now_us(), ch.buckets.at(msg.bucket).size() * std::int64_t(sizeof(float))});
  }
  if (++s.completed < s.order.size()) return;
  s.pending.clear();
  if (collective(msg.kind) == collective::reduce_scatter) return send_norm_partials(self);
  // (The all-gather phase of all chunks, with the bytes of their whole buffers.)
  std::int64_t bytes = 0;
  for (const auto& ch : s.chunks) bytes += ch.gathered.nbytes();
  s.events.push_back({"all-gather", s.rank, s.stage, -1, -1, s.step, s.phase_start_us, s.ctx->now_us(), bytes});
  for (int ci = 0; ci < s.ctx->v; ++ci) {
    s.record_sent("parameters of chunk " + std::to_string(ci), s.stage_actor_name());
    self->send(s.wiring->stages[s.rank][s.stage], param_shard{s.step, ci, s.rank, make_payload(s.chunks[ci].gathered)});
  }
  s.gathered = true;
  maybe_done(self);
}

/// The coordinator's clip factor: the update, the snapshot before the next step, the
/// all-gather and the buddy's copy.
void on_clip_factor(shard_self self, const clip_factor_msg& msg) {
  if (!accept(self, msg.step)) return;
  auto& s = self->state;
  trace_event ev{"optimizer", s.rank, s.stage, -1, -1, s.step, s.ctx->now_us(), 0};
  if (!msg.skip)  // skipped: no update, no AdamW step count (Megatron's loss scaler)
    for (auto& ch : s.chunks) ch.opt.step(ch.reduced, s.lr, msg.factor, s.ctx->cfg.threads);
  // The state before the next step, for in-place retries (no copy: the update wrote
  // the other half of the double-buffered state).
  take_snapshot(s, s.step + 1);
  ev.end_us = s.ctx->now_us();
  s.events.push_back(ev);
  // The copy first where the pieces go at once (parameters sharded): send_pieces reports
  // the step done unless a copy is pending, and shard_done must wait for its
  // acknowledgement (an acknowledgement that came in the next step would be dropped, the
  // copy left pending for ever).
  if (s.ctx->shards_params()) {
    send_copy(self, s.step + 1);
    send_pieces(self);
    return;
  }
  start_all_gathers(self);
  send_copy(self, s.step + 1);
}

/// Checkpoints: AdamW moments by parameter name, and the fp32 main parameters where the
/// stages hold them rounded (bf16 jobs).
shard_moments checkpoint_answer(const shard_state& s) {
  // (Parameters sharded: the main parameters are the only copy, in fp32 jobs too.)
  const bool main = s.ctx->compute_dtype != torch::kFloat32 || s.ctx->shards_params();
  shard_moments rep;
  for (const auto& ch : s.chunks)
    for (auto& piece : moment_pieces(ch.entries, ch.layout, ch.opt, main)) {
      rep.names.push_back(std::move(piece.name));
      rep.offsets.push_back(piece.offset);
      rep.numels.push_back(piece.numel);
      rep.tensors.push_back(make_payload(piece.data));
    }
  return rep;
}

/// Parameters sharded (checkpoint folders written by every shard): this shard's file of
/// the step folder (write_shard_file: its pieces of the fp32 main parameters and the
/// moments), written now or, in the background (msg.background, within the snapshot
/// bound), by a writer actor from a copy taken now. Hybrid sharding: the first shard
/// group's shards write; the copies in the other groups answer with no file.
stage_checkpoint write_shard_checkpoint(shard_self self, const write_checkpoint& msg) {
  const auto& s = self->state;
  const auto& ctx = *s.ctx;
  trace_event ev{"checkpoint snapshot", s.rank, s.stage, -1, -1, msg.step - 1, ctx.now_us(), 0, 0};
  auto now = [c = s.ctx] { return c->now_us(); };
  if (ctx.shard_copy_of(s.rank) != 0) return {};
  std::vector<moment_piece> pieces;
  for (const auto& ch : s.chunks)  // (copies: the shard's state moves on)
    for (auto& piece : moment_pieces(ch.entries, ch.layout, ch.opt, /*main_params=*/true))
      pieces.push_back(std::move(piece));
  stage_files files{msg.folder, s.stage, shard_file_state(pieces, ctx.tp_of(s.rank), ctx.t, msg.step), {}, s.rank};
  pieces.clear();
  ev.end_us = ctx.now_us();
  const auto bytes = snapshot_bytes(files);
  if (msg.background) {
    const auto refused = reserve_snapshot(bytes, ctx.cfg.checkpoint_async_memory);
    if (refused.empty()) {
      stage_checkpoint out;
      ev.bytes = bytes;
      out.events.push_back(ev);
      out.snapshot_bytes = bytes;
      auto written = ev;
      written.start_us = ev.end_us;
      out.writer = spawn_checkpoint_writer(self, std::move(files), bytes, written, now,
                                           s.faults.write_kill(s.wiring->node, msg.step - 1), s.wiring->node);
      return out;
    }
    spdlog::warn("step {}: {} writes its checkpoint file before training goes on: {}", msg.step, s.name, refused);
  }
  return write_files(files, ev, now);
}

shard_actor::behavior_type shard_behavior(shard_self self, std::shared_ptr<const runtime_context> ctx,
                                          std::shared_ptr<const job_wiring> wiring, int stage, int rank,
                                          std::shared_ptr<transport::communicator> comm,
                                          std::shared_ptr<transport::communicator> expert_comm,
                                          std::shared_ptr<snapshot_store> store, std::shared_ptr<const shard_snapshot> from) {
  self->set_exception_handler([](caf::scheduled_actor*, std::exception_ptr& eptr) { return error_from_exception(eptr); });
  auto& st = self->state;
  st.ctx = ctx;
  st.wiring = wiring;
  st.comm = comm;
  st.expert_comm = expert_comm;
  st.store = store;
  st.stage = stage;
  st.rank = rank;
  st.name = ctx->shard_name(stage, rank);
  // Its data-parallel group: the stage's shards of the same tensor-parallel rank.
  // (Hybrid sharding: its shard group's g ranks, the sum still over all d: hybrid.hpp.)
  const int dp = ctx->dp_of(rank) % ctx->g;
  if (comm->size() != ctx->g || comm->rank() != dp)
    throw std::logic_error(st.name + ": communicator is rank " + std::to_string(comm->rank()) + " of " +
                           std::to_string(comm->size()));
  if ((ctx->ep > 1) != bool(expert_comm) ||
      (expert_comm && (expert_comm->size() != ctx->eg || expert_comm->rank() != ctx->expert_shard_rank(rank))))
    throw std::logic_error(st.name + ": no expert-data-parallel communicator of " + std::to_string(ctx->eg) +
                           " ranks with its rank " + std::to_string(ctx->expert_shard_rank(rank)));
  init_chunks(st, from);
  for (int c = ctx->v - 1; c >= 0; --c)
    for (int b = int(st.chunks[c].buckets.size()) - 1; b >= 0; --b) st.order.emplace_back(c, b);
  if (!from) take_snapshot(st, ctx->start_step);
  st.faults = fault_injector(ctx->faults);
  return {
      [self](const begin_step& msg) { on_begin_step(self, msg); },
      [self](grad_shard& msg) { on_grad_shard(self, msg); },
      [self](const collective_done& msg) { on_collective_done(self, msg); },
      [self](const clip_factor_msg& msg) { on_clip_factor(self, msg); },
      [self](const reset_step&) -> reset_report { return drop_step_state(self); },
      [self](wait_atom, std::int64_t step) -> wait_report { return shard_waits(self->state, step); },
      [self](state_atom) -> shard_moments { return checkpoint_answer(self->state); },
      [self](const write_checkpoint& msg) { return write_shard_checkpoint(self, msg); },
      [self](const abort_step& msg) {
        drop_step_state(self);
        self->state.step = msg.step;
      },
  };
}

}  // namespace

shard_actor spawn_optimizer_shard_actor(caf::local_actor* supervisor, std::shared_ptr<const runtime_context> ctx,
                                        std::shared_ptr<const job_wiring> wiring, int stage, int rank,
                                        std::shared_ptr<transport::communicator> comm,
                                        std::shared_ptr<transport::communicator> expert_comm,
                                        std::shared_ptr<snapshot_store> store, std::shared_ptr<const shard_snapshot> from) {
  return supervisor->spawn<caf::monitored>(shard_behavior, std::move(ctx), std::move(wiring), stage, rank,
                                           std::move(comm), std::move(expert_comm), std::move(store), std::move(from));
}

}  // namespace troupe
