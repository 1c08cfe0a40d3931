#include "actors/stage_actor.hpp"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <limits>
#include <numeric>
#include <optional>
#include <future>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include <caf/all.hpp>
#include <torch/torch.h>

#include "actors/activity_board.hpp"
#include "actors/request_all.hpp"
#include "actors/tp_groups.hpp"
#include "compute/checkpoint_dir.hpp"
#include "compute/device.hpp"
#include "compute/grad_buffer.hpp"
#include "compute/tensor_parallel.hpp"
#include "compute/trainer.hpp"
#include "messages/type_ids.hpp"

namespace troupe {

namespace {

using key = std::pair<int, int>;  // (micro-batch, chunk)

// The wait-for graph's names of a stage's messages (the sender's and the receiver's).
std::string activation_text(int mb, int chunk) {
  return "activation mb " + std::to_string(mb) + " chunk " + std::to_string(chunk);
}
std::string gradient_text(int mb, int chunk) {
  return "gradient mb " + std::to_string(mb) + " chunk " + std::to_string(chunk);
}
std::string bucket_text(int chunk, int b) {
  return "gradient bucket " + std::to_string(b) + " of chunk " + std::to_string(chunk);
}

/// The kinds of tensor message a stage receives in a step; each (kind, key) is taken once
/// (a duplicate is dropped).
enum class received { activation, gradient, input, target, parameters, tied_gradient };

struct stage_state {
  std::shared_ptr<const runtime_context> ctx;
  std::shared_ptr<const job_wiring> wiring;
  int replica = 0, stage = 0;
  std::string name;
  std::int32_t generation = 0;  // the in-place recoveries before this actor was spawned
  std::vector<std::unique_ptr<model_slice>> chunks;  // chunk c: virtual stage ctx->virtual_stage(stage, c)
  const std::vector<pipeline_op>* order = nullptr;   // fixed-order kinds
  fault_injector faults;                             // fault injection (tests): this actor's own
  bool stream_set = false;                           // this actor's CUDA stream is its thread's

  bool turn_asked = false;                           // dataflow: a run_atom for a W's turn is on its way

  // --- per-step state (all of it dropped by reset) ---
  std::int64_t step = -1;
  std::int32_t attempt = 0;               // of this step (a step retried in place: > 0)
  bool running = false;
  std::size_t next_op = 0;
  int ops_done = 0, total_ops = 0;
  std::vector<int> chunk_ops;             // per chunk: its ops in a step (fixed for the actor)
  int forwards_done = 0;
  std::vector<int> chunk_ops_left;        // per chunk: ops still to run this step
  std::map<key, torch::Tensor> inputs;    // received inputs / activations
  std::map<key, torch::Tensor> out_grads; // received gradients of outputs
  std::map<int, torch::Tensor> targets;
  std::vector<std::pair<int, torch::Tensor>> losses;  // (micro-batch, loss) until the step's ops are done
  std::set<std::pair<received, key>> seen;  // (kind, key) of every tensor received this step
  struct saved_t {
    torch::Tensor input, output;
  };
  std::map<key, saved_t> saved;           // forwarded, waiting for backward
  std::map<key, weight_grad_store> deferred;  // split backwards: backwarded, waiting for W
  int in_flight = 0, peak_in_flight = 0;
  // On a GPU: each compute op's marks on the stage's stream (its event's index in
  // `events`, start and end mark), put on the job clock as the step's events are reported;
  // dropped with the marks when the next step (or a retry) anchors the clock.
  std::unique_ptr<gpu_op_clock> gpu_clock;  // (kept across steps)
  struct gpu_span {
    std::size_t event;
    int start, end;
  };
  std::vector<gpu_span> gpu_spans;
  bool tied_pending = false;
  torch::Tensor tied_in;
  // Gradient buckets (per chunk): a watch reports each bucket as the step's last backward
  // produces it, and the bucket goes to the shard at once (Megatron's overlapped gradient
  // reduction); a tied chunk's buckets holding the tied embedding wait for its sum.
  std::vector<std::unique_ptr<grad_ready_watch>> watches;  // (kept across steps)
  std::vector<std::vector<char>> tied_bucket;              // per chunk and bucket (kept)
  std::vector<std::vector<int>> held;                      // per chunk: buckets waiting for the tied sum
                                                           // (or the replicated parameters' sum)
  // Sequence parallelism: the buckets holding parameters every tensor-parallel rank holds
  // whole (per chunk and bucket; kept): each rank's gradient covers its positions only,
  // so they wait for the sum over the group (chunk_done).
  std::vector<std::vector<char>> replicated_bucket;
  bool sums_replicated() const { return tp_size > 1 && ctx->sequence_parallel; }
  /// Whether `e` is summed over the tensor-parallel group (sums_replicated): a parameter
  /// every rank holds whole; not the experts, each rank's own (expert_share), which their
  /// shards sum over the expert-data-parallel group.
  bool summed_over_tp(const param_entry& e) const {
    return e.split == tp_split::replicated && !(ctx->ep > 1 && expert_of(e.name) >= 0);
  }
  int params_received = 0;
  std::vector<trace_event> events;
  std::vector<caf::message> stash;        // messages of a later step
  // What it sent this step (for the wait-for graph: its text made only when asked) and its
  // last op. Under a lock: gradient buckets may be handed over from LibTorch's autograd
  // thread.
  struct sent_message {
    enum kind_t : std::uint8_t { loss, credit, bucket, done, activation, gradient, tied } kind = done;
    int a = 0, b = 0;  // loss, credit: (mb); bucket: (chunk, bucket); activation, gradient: (mb, chunk)
    int to = 0;        // activation, gradient, tied: the receiving stage
  };
  std::vector<sent_message> sent;
  std::mutex sent_mutex;
  std::optional<pipeline_op> last_op;  // (its text made only when asked)
  bool done_reported = false;  // stage_done sent for this step
  // Evaluation between steps (forward only): the last virtual stage's outputs and the
  // targets, by forward, until both are here; the evaluation ops' trace events until the
  // coordinator collects them.
  std::map<int, torch::Tensor> eval_outputs, eval_targets;
  std::vector<trace_event> eval_events;
  int ep_size = 1;  // expert parallelism: the size of the stage's expert-parallel group
  int tp_size = 1;  // tensor parallelism: the size of the stage's tensor-parallel group
  std::shared_ptr<collective_group> tp_group;  // (tp_size > 1)
  /// The stage actors that run the same forwards and backwards in one order, meeting in
  /// their collectives (an expert-parallel or a tensor-parallel group; 1: none).
  /// The pipelines that evaluate together: the whole replicas an expert-parallel group
  /// spans (EP consecutive pipelines, tensor-parallel rank fastest), lcm(EP, T).
  int group_size() const { return ep_size / std::gcd(ep_size, tp_size) * tp_size; }
  /// Whether backwards run on the stage's thread (backward_on_this_thread): in a group
  /// (required: its collectives would wait for each other on LibTorch's one autograd
  /// thread per GPU), or when the launcher asks (launch_info::backward_on_stage_threads).
  bool backward_here() const { return group_size() > 1 || ctx->launch.backward_on_stage_threads; }
  // (micro-batch or evaluation forward, chunk) of the forward and of the backward
  // computing now (both at once in an overlapped pair), for their all-to-alls' events.
  key computing_forward{-1, -1}, computing_backward{-1, -1};
  bool in_backward = false;  // the op computing now (not an overlapped pair) is a backward
  std::mutex events_mutex;  // `events` while an overlapped pair's two ops compute
  // Expert and tensor parallelism: the members of a group meet in its collectives, so
  // each runs the same evaluation forwards (those of its group) in one order, (forward,
  // chunk): those that come early wait here; `eval_next` is the next to run (forward -1:
  // the group's first). Tensor parallelism scores them in forward order too (the logits'
  // gather is a collective): `score_next` is the next to score.
  std::map<key, eval_activation> eval_waiting;
  key eval_next{-1, 0};
  int score_next = -1;
  /// Whether this stage scores evaluation forwards: without a group every replica's last
  /// stage, with expert parallelism the first replica of the group's (the others run the
  /// same forwards for the experts they hold), with tensor parallelism each of that
  /// replica's ranks (each holds part of the vocabulary).
  bool scores_evaluation() const { return replica % group_size() < tp_size; }
  /// Whether it reports the scores: the group's rank 0.
  bool reports_evaluation() const { return replica % group_size() == 0; }

  int virtual_of(int chunk) const { return ctx->virtual_stage(stage, chunk); }
  std::string shard_name() const { return ctx->shard_name(stage, replica); }
  std::string loader_name() const { return ctx->loader_name(replica); }
  /// The name of the stage actor owning virtual stage x (this replica's).
  std::string owner_name(int x) const { return ctx->stage_name(replica, ctx->place(x).first); }
  void record_sent(sent_message m) {
    std::lock_guard<std::mutex> lock(sent_mutex);
    sent.push_back(m);
  }
  /// The message_key of a message sent (what its receiver says it waits for).
  std::string sent_key(const sent_message& m) const {
    using k = sent_message;
    switch (m.kind) {
      case k::loss: return message_key("loss mb " + std::to_string(m.a), name, "coordinator");
      case k::credit: return message_key("credit mb " + std::to_string(m.a), name, loader_name());
      case k::bucket: return message_key(bucket_text(m.a, m.b), name, shard_name());
      case k::done: return message_key("stage done", name, "coordinator");
      case k::activation: return message_key(activation_text(m.a, m.b), name, ctx->stage_name(replica, m.to));
      case k::gradient: return message_key(gradient_text(m.a, m.b), name, ctx->stage_name(replica, m.to));
      case k::tied: return message_key("tied gradient", name, ctx->stage_name(replica, m.to));
    }
    return "";
  }
  bool is_last_virtual(int chunk) const { return virtual_of(chunk) == ctx->n_virtual - 1; }
  /// The (replica's) stage actor owning virtual stage x, its stage index, and the chunk index there.
  struct place_of {
    stage_actor actor;
    int stage, chunk;
  };
  place_of owner(int x) const {
    const auto [k, c] = ctx->place(x);
    return {wiring->stages[replica][k], k, c};
  }
  /// The stages holding the first and the last virtual stage: the tied embedding's copies.
  int first_stage() const { return ctx->place(0).first; }
  bool holds_tied_copy() const {
    return !ctx->tied_name.empty() && ctx->n_virtual > 1 && (stage == first_stage() || stage == ctx->loss_stage());
  }
  /// Both copies on this stage (p = 1 with chunks, the V kinds' stage 0): summed here.
  bool tied_here() const { return first_stage() == ctx->loss_stage(); }
  /// The stage holding the other copy (when not tied_here).
  int tied_peer() const { return stage == first_stage() ? ctx->loss_stage() : first_stage(); }
  /// Whether `chunk` holds a copy of the tied embedding (the first virtual stage's, or
  /// the last one's).
  bool is_tied_chunk(int chunk) const {
    return holds_tied_copy() && (virtual_of(chunk) == 0 || is_last_virtual(chunk));
  }
  /// Unless tied_here: the chunk holding this stage's copy of the tied embedding.
  int tied_chunk() const { return virtual_of(0) == 0 ? 0 : ctx->place(ctx->n_virtual - 1).second; }
  /// Whether the backward of (micro-batch, chunk) leaves its weights' gradients to a W op:
  /// the schedule's op says (dataflow: split_backward says for all).
  bool splits(const std::pair<int, int>& k) const { return ctx->dataflow ? ctx->split_backward : split_keys.count(k) > 0; }
  std::set<std::pair<int, int>> split_keys;  // fixed orders: the (mb, chunk) of split backwards
};

/// Megatron's deallocate_output_tensor: the output's data goes (the receiver holds its
/// own reference), its autograd node stays for the backward.
void deallocate(torch::Tensor& out) { out.set_data(torch::empty({1}, out.options())); }

using stage_self = stage_actor::stateful_pointer<stage_state>;

class stage_logic {
 public:
  stage_logic(stage_self self) : self_(self), s_(self->state) {}

  bool ready(const pipeline_op& op) const {
    const key k{op.mb, op.chunk};
    if (op.kind == op_kind::forward) {
      if (!s_.inputs.count(k)) return false;
      return !s_.is_last_virtual(op.chunk) || s_.targets.count(op.mb);
    }
    if (op.kind == op_kind::weight) return s_.deferred.count(k) && !s_.saved.count(k);
    if (!s_.saved.count(k)) return false;
    return s_.is_last_virtual(op.chunk) || s_.out_grads.count(k);
  }

  /// Runs every op that can run now. Dataflow with a split backward runs a W when no F
  /// or B can run and the W is due (`weight_due`), one per turn (`weight_turn`): between
  /// two W's the mailbox is read, so an activation or gradient that arrived meanwhile
  /// goes first.
  void run_ready(bool weight_turn = false) {
    if (!s_.running) return;
    if (s_.order) {
      const auto& order = *s_.order;
      while (s_.next_op < order.size()) {
        const auto& op = order[s_.next_op];
        if (op.paired && s_.next_op + 1 < order.size() && overlaps_pairs()) {
          if (!ready(op) || !ready(order[s_.next_op + 1])) break;
          s_.next_op += 2;
          execute_pair(op, order[s_.next_op - 1]);
          continue;
        }
        if (!ready(op)) break;
        ++s_.next_op;
        execute(op);
      }
    } else {
      for (;;) {
        if (auto op = next_dataflow_op()) {
          execute(*op);
        } else if (auto w = next_weight_op(); w && weight_due()) {
          if (!weight_turn) {
            if (!s_.turn_asked) self_->send(self_, run_atom_v);  // a turn after what waits in the mailbox
            s_.turn_asked = true;
            break;
          }
          execute(*w);
          weight_turn = false;
        } else {
          break;
        }
      }
    }
    if (s_.ops_done == s_.total_ops && s_.running) {
      report_losses();
      after_backward();
    }
  }

  /// The last stage's losses of this step, read from the device once (one host sync).
  /// (Tensor parallelism: the group's rank 0; every rank computed the same losses.)
  void report_losses() {
    if (s_.ctx->tp_of(s_.replica) != 0) s_.losses.clear();
    for (auto& [mb, loss] : s_.losses) {
      loss_report rep{s_.step, s_.replica, mb, loss.item<double>()};
      s_.record_sent({stage_state::sent_message::loss, mb});
      if (!report_fault(message_target::loss_report, "loss report", rep)) self_->send(s_.wiring->coordinator, rep);
    }
    s_.losses.clear();
  }

  /// Fault injection, once: the first report of `target` (a loss report, an evaluation
  /// result) to the coordinator of the faulty step is dropped, duplicated or delayed. True
  /// when it was taken care of (dropped or delayed), false when it is still to be sent.
  template <class Report>
  bool report_fault(message_target target, const char* what, const Report& rep) {
    const auto fault = s_.faults.take_message(s_.replica, s_.stage, s_.step, s_.attempt, target);
    if (!fault) return false;
    spdlog::warn("fault injected: {} {}s its first {} of step {} (index {})", s_.name, name(fault->action), what,
                 s_.step + 1, s_.step);
    if (fault->action == message_action::duplicate) self_->send(s_.wiring->coordinator, rep);
    if (fault->action == message_action::delay) self_->delayed_send(s_.wiring->coordinator, delay_of(*fault), rep);
    return fault->action == message_action::drop || fault->action == message_action::delay;
  }

  static std::chrono::microseconds delay_of(const message_fault& f) {
    return std::chrono::microseconds(std::int64_t(f.delay_seconds * 1e6));
  }

  std::optional<pipeline_op> next_dataflow_op() const {
    // Backwards first (they free memory), lowest micro-batch first; then forwards if
    // the in-flight bound allows.
    for (const auto& [k, sv] : s_.saved) {
      pipeline_op op{op_kind::backward, k.first, k.second};
      if (ready(op)) return op;
    }
    if (s_.in_flight >= in_flight_bound()) return std::nullopt;
    for (const auto& [k, t] : s_.inputs) {
      pipeline_op op{op_kind::forward, k.first, k.second};
      if (ready(op)) return op;  // inputs leave the buffer when forwarded
    }
    return std::nullopt;
  }

  int in_flight_bound() const { return s_.ctx->cfg.max_in_flight > 0 ? s_.ctx->cfg.max_in_flight : s_.ctx->p; }

  /// Dataflow: a W is due when the next forward waits for one (the in-flight bound is
  /// reached) or when this stage has no forward left in the step (its cool-down, where it
  /// would idle while the last backwards travel back). Not in the gaps between a stage's
  /// F's and B's: those are shorter than a W, and a W started there delays the F or B
  /// that arrives during it. (Measured, p=2 on 2 cores, 1f1b's step time over this
  /// one's: with a W in every gap 0.88 and 0.93 at 4 micro-batches, 1.00 and 0.95 at 8;
  /// with this rule 0.94-1.07 and 0.99-1.02, zero-bubble's range.)
  bool weight_due() const {
    return s_.in_flight >= in_flight_bound() || s_.forwards_done == s_.ctx->m * s_.ctx->v;
  }

  /// Dataflow's next W: the lowest micro-batch whose B has run.
  std::optional<pipeline_op> next_weight_op() const {
    for (const auto& [k, store] : s_.deferred) {
      pipeline_op op{op_kind::weight, k.first, k.second};
      if (ready(op)) return op;
    }
    return std::nullopt;
  }

  /// Fault injection at the step's second op: the stage throws, or its thread blocks (an
  /// actor that stops answering: its mailbox is not read meanwhile).
  void inject_op_faults() {
    if (s_.faults.stage_throws(s_.replica, s_.stage, s_.step, s_.attempt, throw_point::in_step)) {
      spdlog::warn("fault injected: {} throws in step {} (index {})", s_.name, s_.step + 1, s_.step);
      throw std::runtime_error("injected fault: " + s_.name + " throws in step " + std::to_string(s_.step + 1));
    }
    if (const auto seconds = s_.faults.take_freeze(s_.replica, s_.stage, s_.step, s_.attempt)) {
      spdlog::warn("fault injected: {} blocks its thread for {} s in step {} (index {})", s_.name, *seconds,
                   s_.step + 1, s_.step);
      std::this_thread::sleep_for(std::chrono::duration<double>(*seconds));
    }
  }

  /// One op in three parts: begin (on the stage's thread: takes its inputs), compute (its
  /// slice's forward, backward or weight pass only; an overlapped pair's forward runs it
  /// on a thread of its own), end (on the stage's thread: sends and bookkeeping).
  struct op_work {
    pipeline_op op;
    key k;
    int x = 0;
    trace_event ev;
    int gpu_start = -1;
    bool split = false;
    weight_grad_store* store = nullptr;  // a split forward's W store, or a W's
    torch::Tensor in, out, loss, target;  // forward
    stage_state::saved_t sv;             // backward: the forward's input and output
    torch::Tensor grad;                  // backward: the gradient of its output (not on the last virtual stage)
    double computed_us = -1;             // an overlapped op: when its compute ended
  };

  op_work begin_op(const pipeline_op& op) {
    const auto& ctx = *s_.ctx;
    op_work w;
    w.op = op;
    w.k = {op.mb, op.chunk};
    w.x = s_.virtual_of(op.chunk);
    w.ev = trace_event{op_letter(op.kind), s_.replica, s_.stage, op.mb, op.chunk, s_.step, ctx.now_us(), 0};
    w.gpu_start = s_.gpu_clock ? s_.gpu_clock->mark() : -1;
    w.split = s_.splits(w.k);
    if (op.kind == op_kind::weight) {
      w.store = &s_.deferred[w.k];
    } else if (op.kind == op_kind::forward) {
      w.in = std::move(s_.inputs[w.k]);
      s_.inputs.erase(w.k);
      if (w.x > 0) w.in = w.in.detach().requires_grad_(true);
      if (s_.is_last_virtual(op.chunk)) w.target = s_.targets[op.mb];
      if (w.split) w.store = &s_.deferred[w.k];
    } else {
      w.sv = std::move(s_.saved[w.k]);
      s_.saved.erase(w.k);
      // The chunk's last op: its buckets go to the shard as this backward finishes them
      // (split backwards: after their W's, in chunk_done).
      if (!w.split && s_.chunk_ops_left.at(op.chunk) == 1) s_.watches.at(op.chunk)->arm();
      if (!s_.is_last_virtual(op.chunk)) {
        w.grad = std::move(s_.out_grads[w.k]);
        s_.out_grads.erase(w.k);
      }
    }
    return w;
  }

  /// The op's compute: its slice (and a split op's W store) only, and the expert
  /// all-to-alls' trace events (under their lock).
  void compute(op_work& w) {
    const auto& ctx = *s_.ctx;
    auto& slice = *s_.chunks[w.op.chunk];
    activity_board::op_scope busy(s_.name, s_.wiring->node, s_.generation, s_.step, op_letter(w.op.kind), w.op.mb,
                                  w.op.chunk);
    if (w.op.kind == op_kind::forward) s_.computing_forward = w.k;
    if (w.op.kind == op_kind::backward) s_.computing_backward = w.k;
    s_.in_backward = w.op.kind == op_kind::backward;
    if (w.op.kind == op_kind::weight) {
      w.store->apply();
    } else if (w.op.kind == op_kind::forward) {
      precision_scope amp(ctx.device, ctx.compute_dtype);
      if (w.split) slice.defer_weight_grads(w.store);
      w.out = slice.forward(w.in);
      slice.defer_weight_grads(nullptr);
      if (s_.is_last_virtual(w.op.chunk)) w.loss = slice.loss(w.out, w.target);
    } else {
      // Expert parallelism on a GPU: the backward on this thread, not on LibTorch's one
      // autograd thread for the device, where the group's backward all-to-alls would
      // wait for each other (compute/device.hpp).
      backward_on_this_thread here(s_.backward_here());
      if (s_.is_last_virtual(w.op.chunk))
        w.sv.output.backward();
      else
        torch::autograd::backward({w.sv.output}, {w.grad.to(w.sv.output.scalar_type())});
    }
  }

  void end_op(op_work& w) {
    const auto& ctx = *s_.ctx;
    const auto& op = w.op;
    if (op.kind == op_kind::weight) {
      s_.deferred.erase(w.k);
      --s_.in_flight;
    } else if (op.kind == op_kind::forward) {
      auto out = std::move(w.out);
      if (s_.is_last_virtual(op.chunk)) {
        auto loss = std::move(w.loss);
        if (s_.faults.nan_loss(s_.step, s_.attempt))  // fault injection
          loss = loss * std::numeric_limits<double>::quiet_NaN();
        s_.targets.erase(op.mb);
        s_.losses.emplace_back(op.mb, loss.detach());  // reported after the last op: no sync now
        out = loss * (double(ctx.mbs) / ctx.cfg.global_batch);
      } else {
        const auto next = s_.owner(w.x + 1);
        // Activations travel in the compute dtype (bf16 jobs: half the bytes, as Megatron's
        // pipeline sends bf16); the receiver widens them to fp32.
        send_tensor(next.stage, next.actor,
                    forward_activation{s_.step, op.mb, next.chunk,
                                       make_payload(out.detach().to(ctx.compute_dtype), ctx.cfg.checksum)},
                    "activation", op.mb, op.chunk);
        deallocate(out);
      }
      if (w.x == 0) {
        s_.record_sent({stage_state::sent_message::credit, op.mb});
        self_->send(s_.wiring->loaders[s_.replica], credit{s_.step, op.mb});
      }
      s_.saved[w.k] = {w.in, out};
      s_.peak_in_flight = std::max(s_.peak_in_flight, ++s_.in_flight);
      ++s_.forwards_done;
    } else {
      if (w.x > 0) {
        const auto prev = s_.owner(w.x - 1);
        send_tensor(prev.stage, prev.actor,
                    backward_grad{s_.step, op.mb, prev.chunk,
                                  make_payload(w.sv.input.grad().to(ctx.compute_dtype), ctx.cfg.checksum)},
                    "gradient",
                    op.mb, op.chunk);
      }
      if (!w.split) --s_.in_flight;  // split: the W's inputs stay until it runs
    }
    s_.last_op = op;
    w.ev.end_us = w.computed_us >= 0 ? w.computed_us : ctx.now_us();
    if (w.gpu_start >= 0) s_.gpu_spans.push_back({s_.events.size(), w.gpu_start, s_.gpu_clock->mark()});
    push_event(std::move(w.ev));
    ++s_.ops_done;
    if (--s_.chunk_ops_left.at(op.chunk) == 0) chunk_done(op.chunk);
  }

  void push_event(trace_event ev) {
    std::lock_guard<std::mutex> lock(s_.events_mutex);
    s_.events.push_back(std::move(ev));
  }

  void execute(const pipeline_op& op) {
    if (s_.ops_done == 1) inject_op_faults();
    auto w = begin_op(op);
    compute(w);
    end_op(w);
  }

  /// Whether a pair's two ops run at once: asked for (parallel.overlap_pairs), with expert
  /// parallelism (whose all-to-alls they hide behind each other's compute), on the CPU,
  /// without recomputation (a recomputing backward flags its slice, which a forward
  /// beside it would see) and without tensor parallelism (the two ops' collectives on the
  /// one tensor-parallel group would meet in different orders on its ranks). Else one
  /// after the other.
  bool overlaps_pairs() const {
    const auto& ctx = *s_.ctx;
    return ctx.cfg.overlap_pairs && s_.ep_size > 1 && s_.tp_size == 1 && ctx.device.is_cpu() &&
           ctx.cfg.recompute == "none";
  }

  /// An overlapped pair (combined-1f1b, dualpipev): the backward computes on the stage's
  /// thread while the forward computes on a thread of its own, each calling its own
  /// expert-parallel group's all-to-alls, so that one's wait hides behind the other's
  /// compute. Both inputs are taken first and both results handed on after.
  void execute_pair(const pipeline_op& f, const pipeline_op& b) {
    if (s_.ops_done <= 1) inject_op_faults();
    auto wf = begin_op(f), wb = begin_op(b);
    const int threads = s_.ctx->cfg.threads;
    auto forward = std::async(std::launch::async, [this, &wf, threads] {
      if (threads > 0) torch::set_num_threads(threads);
      compute(wf);
      wf.computed_us = s_.ctx->now_us();
    });
    std::exception_ptr failed;
    try {
      compute(wb);
      wb.computed_us = s_.ctx->now_us();
    } catch (...) {
      failed = std::current_exception();
    }
    try {
      forward.get();
    } catch (...) {
      if (!failed) failed = std::current_exception();
    }
    if (failed) std::rethrow_exception(failed);
    end_op(wf);
    end_op(wb);
  }

  /// A chunk's ops all ran: its gradients are final (but for a tied embedding's, which
  /// the first and last stage sum first). Its buckets not handed over during the last
  /// backward go to the shard now, while the stage runs the other chunks' backwards
  /// (interleaved schedules: Megatron's overlap of a model chunk's gradient reduction
  /// with the rest of the backward).
  void chunk_done(int chunk) {
    const auto& ctx = *s_.ctx;
    s_.watches.at(chunk)->finish();
    if (s_.sums_replicated()) {
      activity_board::op_scope busy(s_.name, s_.wiring->node, s_.generation, s_.step,
                                    "the sum of the replicated parameters' gradients", -1, chunk);
      sum_replicated_grads(*s_.chunks.at(chunk));
      if (!s_.is_tied_chunk(chunk)) send_held(chunk);  // (a tied chunk's wait for the tied sum too)
    }
    if (!s_.is_tied_chunk(chunk)) return;
    if (s_.tied_here()) return;  // both copies here: summed once every op ran (after_backward)
    auto& mine = tied_slice().param(ctx.tied_name).mutable_grad();
    const auto peer = s_.tied_peer();
    send_tensor(peer, s_.wiring->stages[s_.replica][peer],
                tied_grad{s_.step, make_payload(mine.clone(), ctx.cfg.checksum)}, "tied gradient", -1, -1);
    s_.tied_pending = true;
    if (s_.tied_in.defined()) on_tied(std::move(s_.tied_in));
  }

  /// Sequence parallelism: the gradients of the parameters every rank holds whole, summed
  /// over the tensor-parallel group (one all-reduce of them all; every rank calls it in
  /// the same place of the same op order).
  void sum_replicated_grads(model_slice& slice) {
    torch::NoGradGuard no_grad;
    std::vector<torch::Tensor> grads;
    for (const auto& e : slice.entries())
      if (s_.summed_over_tp(e)) grads.push_back(slice.param(e.name).mutable_grad());
    if (grads.empty()) return;
    std::vector<torch::Tensor> flat;
    for (const auto& g : grads) flat.push_back(g.reshape({-1}));
    auto sum = torch::cat(flat);
    s_.tp_group->all_reduce(sum);
    std::int64_t at = 0;
    for (auto& g : grads) {
      g.copy_(sum.narrow(0, at, g.numel()).view(g.sizes()));
      at += g.numel();
    }
  }

  /// All ops ran (every chunk's buffer is with the shard or waits for the tied gradient).
  void after_backward() {
    s_.running = false;
    const auto& ctx = *s_.ctx;
    if (s_.holds_tied_copy() && s_.tied_here()) {  // both copies here: sum locally, as the reference does
      auto& first = s_.chunks.at(ctx.place(0).second)->param(ctx.tied_name).mutable_grad();
      auto& last = s_.chunks.at(ctx.place(ctx.n_virtual - 1).second)->param(ctx.tied_name).mutable_grad();
      {
        torch::NoGradGuard g;
        first.add_(last);
        last.copy_(first);
      }
      for (int c = 0; c < ctx.v; ++c) send_held(c);
    }
  }

  model_slice& tied_slice() { return *s_.chunks.at(s_.tied_chunk()); }

  void on_tied(torch::Tensor other) {
    if (!s_.tied_pending) {  // our own tied chunk is not done yet: keep it for later
      s_.tied_in = std::move(other);
      return;
    }
    {
      torch::NoGradGuard g;
      tied_slice().param(s_.ctx->tied_name).mutable_grad().add_(other);
    }
    s_.tied_pending = false;
    s_.tied_in = torch::Tensor();
    send_held(s_.tied_chunk());
  }

  /// A watch reported bucket `b` of `chunk` final: to the shard, or held for the tied sum.
  /// (With CUDA this runs on LibTorch's autograd thread while the actor's thread waits
  /// for its backward.)
  void bucket_ready(int chunk, int b) {
    if ((s_.tied_bucket.at(chunk).at(b) && s_.is_tied_chunk(chunk)) || s_.replicated_bucket.at(chunk).at(b)) {
      s_.held.at(chunk).push_back(b);
      return;
    }
    send_bucket(chunk, b);
  }

  void send_held(int chunk) {
    for (int b : s_.held.at(chunk)) send_bucket(chunk, b);
    s_.held.at(chunk).clear();
  }

  /// Hands bucket `b` of a chunk's grad buffer to this replica's shard of the stage (same
  /// process; the message carries the whole buffer). anon_send: it may run on another
  /// thread than the actor's (see bucket_ready).
  void send_bucket(int chunk, int b) {
    s_.record_sent({stage_state::sent_message::bucket, chunk, b});
    caf::anon_send(s_.wiring->shards[s_.stage][s_.replica],
                   grad_shard{s_.step, chunk, s_.replica, b, make_payload(s_.chunks[chunk]->flat_grads())});
  }

  void on_params(const param_shard& msg) {
    if (s_.faults.stage_throws(s_.replica, s_.stage, s_.step, s_.attempt, throw_point::after_update)) {
      spdlog::warn("fault injected: {} throws in step {} (index {}) as its updated parameters arrive", s_.name,
                   s_.step + 1, s_.step);
      throw std::runtime_error("injected fault: " + s_.name + " throws after the update in step " +
                               std::to_string(s_.step + 1));
    }
    auto& chunk = *s_.chunks.at(msg.chunk);
    // bf16 jobs: the shards gather their main parameters rounded to bf16.
    const auto problem = check_payload(msg.data, {chunk.flat_params().numel()}, s_.ctx->compute_dtype);
    if (!problem.empty()) throw std::runtime_error(s_.name + ": parameters from the shard: " + problem);
    chunk.set_params(tensor_of(msg.data));
    if (++s_.params_received == s_.ctx->v) {
      // On a GPU the compute ops' spans are when the stream ran them (their kernels were
      // done before the gradients they made were reduced), not when the host launched them.
      for (const auto& g : s_.gpu_spans) {
        s_.events[g.event].start_us = s_.gpu_clock->at_us(g.start);
        s_.events[g.event].end_us = s_.gpu_clock->at_us(g.end);
      }
      s_.record_sent({stage_state::sent_message::done});
      s_.done_reported = true;
      double aux = 0;  // (experts)
      expert_counts routed;
      for (auto& chunk : s_.chunks) {
        aux += chunk->take_aux_loss();
        add_expert_counts(routed, chunk->take_expert_tokens());
      }
      // (A tensor-parallel group's ranks computed the same load-balancing loss, rank 0
      // reports it; each routed its own part of the sequences.)
      if (s_.ctx->tp_of(s_.replica) != 0) aux = 0;
      std::vector<std::int64_t> flat;
      for (const auto& [layer, counts] : routed) {
        flat.push_back(layer);
        flat.insert(flat.end(), counts.begin(), counts.end());
      }
      self_->send(s_.wiring->coordinator, stage_done{s_.step, s_.replica, s_.stage, s_.peak_in_flight,
                                                     std::move(s_.events), aux, std::move(flat)});
    }
  }

  /// Drops per-step state; returns what was left over that should not have been.
  reset_report reset() {
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
    for (auto& c : s_.chunks) {
      c->zero_grads();
      for (const auto& p : c->parameters())
        if (static_cast<char*>(p.grad().data_ptr()) < static_cast<char*>(c->flat_grads().data_ptr()) ||
            static_cast<char*>(p.grad().data_ptr()) >= static_cast<char*>(c->flat_grads().data_ptr()) + c->flat_grads().nbytes())
          rep.leftovers.push_back("a gradient is no longer a view of the grad buffer");
      if (c->flat_grads().abs().sum().item<double>() != 0.0) rep.leftovers.push_back("grad buffer not zero");
    }
    return rep;
  }

  /// True if a message of step `step` may be handled now; stashes later steps' messages.
  bool accept(std::int64_t step) {
    if (step == s_.step) return true;
    if (step > s_.step) s_.stash.push_back(self_->current_mailbox_element()->move_content_to_message());
    return false;
  }

  /// Buffers a received activation or gradient after checking it, then runs what is ready.
  void receive(std::map<key, torch::Tensor>& into, std::int64_t step, int mb, int chunk, const tensor_payload& data,
               const std::vector<std::int64_t>& shape, const char* what) {
    if (!accept(step)) return;
    if (!first_time(&into == &s_.inputs ? received::activation : received::gradient, {mb, chunk}, what)) return;
    const auto problem = check_payload(data, shape, s_.ctx->compute_dtype);
    if (!problem.empty()) return fail(std::string(what) + " of micro-batch " + std::to_string(mb) + ": " + problem);
    // The stage computes from its residual stream's dtype (fp32 unless fp32_residual = false).
    into[{mb, chunk}] = tensor_of(data).to(s_.ctx->device, s_.ctx->residual_dtype);
    trace_comm("recv", what, mb, chunk, s_.ctx->now_us(), payload_bytes(data));
    run_ready();
  }

  /// A send ("send <what>": the time the send took on this actor, the hand-off or the
  /// start of a transfer) or receive ("recv <what>": when it was accepted) trace event,
  /// with the tensor's bytes.
  void trace_comm(const char* dir, const char* what, int mb, int chunk, double start_us, std::int64_t bytes) {
    push_event({std::string(dir) + " " + what, s_.replica, s_.stage, mb, chunk, s_.step, start_us, s_.ctx->now_us(),
                bytes});
  }

  /// False (and a warning) for a second copy of a tensor message of this step: a
  /// duplicate is dropped, never applied twice.
  bool first_time(received kind, key k, const char* what) {
    if (s_.seen.insert({kind, k}).second) return true;
    spdlog::warn("{}: duplicate {} of micro-batch {} (chunk {}) in step {} dropped", s_.name, what, k.first, k.second,
                 s_.step + 1);
    return false;
  }

  void fail(const std::string& what) {
    self_->send(s_.wiring->coordinator, runtime_failure{s_.step, s_.name, what, s_.wiring->generation});
  }

  // --- the wait-for graph (hang diagnosis) ---

  static stage_state::sent_message sent_of(const forward_activation& m, int to) {
    return {stage_state::sent_message::activation, m.mb, m.chunk, to};
  }
  static stage_state::sent_message sent_of(const backward_grad& m, int to) {
    return {stage_state::sent_message::gradient, m.mb, m.chunk, to};
  }
  static stage_state::sent_message sent_of(const tied_grad&, int to) {
    return {stage_state::sent_message::tied, 0, 0, to};
  }

  /// What this stage waits for in `step`, from whom, and what it sent.
  wait_report waits(std::int64_t step) {
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
    if (s_.step < step) {
      rep.state = s_.step < 0 ? "has run no step" : "still at step " + std::to_string(s_.step + 1);
      wait("begin of step " + std::to_string(step + 1), "coordinator");
      return rep;
    }
    if (s_.step > step) {
      rep.state = "already at step " + std::to_string(s_.step + 1);
      return rep;
    }
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

  /// The op this running stage cannot run for want of a message: in a fixed order the
  /// next one; in dataflow the lowest micro-batch's backward waiting for its gradient,
  /// else the next forward waiting for its input.
  std::optional<pipeline_op> next_blocked_op() const {
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

  /// Sends a message with a tensor to stage `dest_stage` of this replica and traces it
  /// (`what`, and this stage's micro-batch and chunk).
  template <class Msg>
  void send_tensor(int dest_stage, const stage_actor& dest, Msg msg, const char* what, int mb, int chunk) {
    s_.record_sent(sent_of(msg, dest_stage));  // a message lost on the way counts as sent
    const double start = s_.ctx->now_us();
    const auto bytes = payload_bytes(msg.data);
    deliver(dest_stage, dest, std::move(msg));
    trace_comm("send", what, mb, chunk, start, bytes);
  }

  /// In-process hand-off, or over the world communicator when that stage is on another node.
  template <class Msg>
  void deliver(int dest_stage, const stage_actor& dest, Msg msg) {
    const auto& w = *s_.wiring;
    // Fault injection, once: the first tensor message of the step.
    if (const auto fault = s_.faults.take_message(s_.replica, s_.stage, s_.step, s_.attempt, message_target::tensor)) {
      spdlog::warn("fault injected: {} {}s its first tensor message of step {} (index {})", s_.name,
                   name(fault->action), s_.step + 1, s_.step);
      switch (fault->action) {
        case message_action::drop: return;
        case message_action::corrupt:  // one value changes after the checksum was taken
          msg.data.local = msg.data.local.clone();
          msg.data.local.view(-1)[0].add_(1.0);
          break;
        case message_action::duplicate: deliver(dest_stage, dest, msg); break;
        case message_action::delay:
          if (w.remote(s_.replica, dest_stage))
            msg.data = ship_payload(w, msg.data, w.nodes[s_.replica][dest_stage], s_.name);
          self_->delayed_send(dest, delay_of(*fault), std::move(msg));
          return;
      }
    }
    send_to_stage(dest_stage, dest, std::move(msg));
  }

  /// Hands `msg` to stage `dest_stage` of this replica: in process, or its tensor over the
  /// world communicator when that stage is on another node.
  template <class Msg>
  void send_to_stage(int dest_stage, const stage_actor& dest, Msg msg) {
    const auto& w = *s_.wiring;
    if (w.remote(s_.replica, dest_stage)) msg.data = ship_payload(w, msg.data, w.nodes[s_.replica][dest_stage], s_.name);
    self_->send(dest, std::move(msg));
  }

  // --- evaluation: forward only, between steps ---

  /// Evaluation messages belong to the step just committed (the stage is between steps);
  /// anything else is stale and dropped.
  bool eval_accepts(std::int64_t step, const char* what) {
    if (step == s_.step && !s_.running) return true;
    spdlog::warn("{}: evaluation {} after step {} dropped (the stage is at step {}{})", s_.name, what, step + 1,
                 s_.step + 1, s_.running ? ", running" : "");
    return false;
  }

  /// Checks an evaluation activation and runs it (expert parallelism: in its turn).
  void on_eval_activation(const eval_activation& msg) {
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

  /// Runs evaluation forward `msg.index` through chunk `msg.chunk` (no autograd, the
  /// training forward's precision), then hands the activation on, or keeps the last
  /// virtual stage's output to score once its targets are here.
  void run_eval_forward(const eval_activation& msg) {
    const auto& ctx = *s_.ctx;
    const int x = s_.virtual_of(msg.chunk);
    if (s_.faults.stage_throws(s_.replica, s_.stage, s_.step, 0, throw_point::in_evaluation)) {  // fault injection
      spdlog::warn("fault injected: {} throws in the evaluation after step {} (index {})", s_.name, s_.step + 1, s_.step);
      throw std::runtime_error("injected fault: " + s_.name + " throws in the evaluation after step " +
                               std::to_string(s_.step + 1));
    }
    auto in = tensor_of(msg.data).to(ctx.device);
    if (x > 0) in = in.to(ctx.residual_dtype);  // the stage computes from its residual stream's dtype
    trace_event ev{"eval F", s_.replica, s_.stage, msg.index, msg.chunk, s_.step, ctx.now_us(), 0};
    s_.computing_forward = {msg.index, msg.chunk};
    s_.in_backward = false;
    torch::NoGradGuard no_grad;
    torch::Tensor out;
    {
      precision_scope amp(ctx.device, ctx.compute_dtype);
      out = s_.chunks[msg.chunk]->forward(in);
    }
    ev.end_us = ctx.now_us();
    s_.eval_events.push_back(std::move(ev));
    if (!s_.is_last_virtual(msg.chunk)) {
      const auto next = s_.owner(x + 1);
      send_to_stage(next.stage, next.actor,
                    eval_activation{s_.step, msg.index, next.chunk,
                                    make_payload(out.to(ctx.compute_dtype), ctx.cfg.checksum)});
      return;
    }
    if (!s_.scores_evaluation()) return;
    s_.eval_outputs[msg.index] = out;
    score_eval(msg.index);
  }

  void on_eval_target(const eval_target& msg) {
    if (!eval_accepts(msg.step, "target")) return;
    const auto problem = check_payload(msg.data, msg.data.shape, torch::kInt64);
    if (!problem.empty()) return fail("evaluation target of forward " + std::to_string(msg.index) + ": " + problem);
    s_.eval_targets[msg.index] = tensor_of(msg.data).to(s_.ctx->device);
    score_eval(msg.index);
  }

  /// Last stage: scores forward `index` once its output and its targets are both here
  /// (tensor parallelism: the group's forwards in order).
  void score_eval(int index) {
    if (s_.tp_size == 1) return score_eval_now(index);
    const int groups = s_.ctx->pipes / s_.group_size();
    if (s_.score_next < 0) s_.score_next = s_.replica / s_.group_size();
    while (s_.eval_outputs.count(s_.score_next) && s_.eval_targets.count(s_.score_next)) {
      const int next = s_.score_next;
      s_.score_next += groups;
      score_eval_now(next);
    }
  }

  void score_eval_now(int index) {
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
    s_.eval_outputs.erase(out);
    s_.eval_targets.erase(target);
    if (!s_.reports_evaluation()) return;
    const eval_result result{s_.step, s_.replica, index, score.weighted, score.correct};
    if (!report_fault(message_target::eval_result, "evaluation result", result))
      self_->send(s_.wiring->coordinator, result);
  }

  /// True when `msg`'s tensor is here; otherwise starts receiving its bytes and sends the
  /// message (tensor in place) to this actor again once they are in.
  template <class Msg>
  bool fetched(const Msg& msg) {
    if (msg.data.src_node < 0) return true;
    auto me = caf::actor_cast<stage_actor>(self_);
    fetch_payload(*s_.wiring, msg.data,
                  [me, m = Msg(msg), coordinator = s_.wiring->coordinator, name = s_.name,
                   generation = s_.wiring->generation](tensor_payload p, const std::string& err) mutable {
                    if (!err.empty())
                      return caf::anon_send(coordinator,
                                            runtime_failure{m.step, name, "tensor receive: " + err, generation});
                    m.data = std::move(p);
                    caf::anon_send(me, std::move(m));
                  },
                  s_.ctx->device);  // on the GPU: a device-to-device copy where the bytes come through CUDA IPC
    return false;
  }

 private:
  stage_self self_;
  stage_state& s_;
};

}  // namespace

namespace {

/// A group collective's end, on the trace: on the stage's track inside the op it served.
/// It is told on the thread computing the op (the stage's, an overlapped pair's
/// forward's, or autograd's in a backward while the stage's thread waits for it).
/// `backward`: whether the op is the backward; `prefix`: the tensor-parallel group's
/// events are "tp all-reduce", ...
collective_observer group_observer(stage_state* state, std::function<bool()> backward, std::string prefix = "") {
  return [state, backward, prefix](const char* name, std::int64_t bytes, double seconds) {
    activity_board::leave_collective();
    const double end = state->ctx->now_us();
    const auto k = backward() ? state->computing_backward : state->computing_forward;
    std::lock_guard<std::mutex> lock(state->events_mutex);
    (state->running ? state->events : state->eval_events)
        .push_back({prefix + name, state->replica, state->stage, k.first, k.second, state->step, end - seconds * 1e6,
                    end, bytes});
  };
}

/// The hang diagnosis's view of a thread waiting in one of its group's collectives
/// (activity_board): the group `label`, its members (pipelines `first` .. first + size - 1
/// of this stage), the call.
collective_entry group_entry(const stage_state& st, std::string label, int first, int size) {
  group_identity id{std::move(label), {}};
  for (int i = 0; i < size; ++i) id.members.push_back(st.ctx->stage_name(first + i, st.stage));
  auto group = std::make_shared<const group_identity>(std::move(id));
  auto calls = std::make_shared<std::int64_t>(0);
  return [group, calls](const char* name) { activity_board::enter_collective(name, group, (*calls)++); };
}

/// Tensor parallelism (`tensors`: this stage's group, else null): the slices' place.
tensor_parallel join_tensor_group(stage_state& st, const std::shared_ptr<transport::communicator>& tensors) {
  if (!tensors) return {};
  const auto& ctx = *st.ctx;
  if (tensors->size() != ctx.t || tensors->rank() != ctx.tp_of(st.replica))
    throw std::logic_error(st.name + ": tensor-parallel communicator is rank " + std::to_string(tensors->rank()) +
                           " of " + std::to_string(tensors->size()));
  st.tp_size = tensors->size();
  const int dp = ctx.dp_of(st.replica);
  auto* state = &st;
  st.tp_group = as_collective_group(
      tensors, nullptr, group_observer(state, [state] { return state->in_backward; }, "tp "),
      group_entry(st, fmt::format("tensor-parallel group of replica {}, stage {}", dp, st.stage), dp * ctx.t, ctx.t));
  return {tensors->rank(), tensors->size(), ctx.sequence_parallel, st.tp_group};
}

/// The stage's chunks: bf16 jobs get bf16 parameters (the initial ones rounded, as the
/// all-gather rounds); restarted in place, the parameters before the step being retried
/// (`params`: the shards' fp32 main parameters, which the supervisor gathered in rank
/// order, per region: the dense one's over the data-parallel group, the experts' over
/// theirs; every bucket's pieces go back in place, rounded as the all-gather rounds).
void make_chunks(stage_state& st, const tensor_parallel& tp, const std::vector<torch::Tensor>& params) {
  const auto& ctx = *st.ctx;
  for (int c = 0; c < ctx.v; ++c) {
    st.chunks.push_back(make_slice(ctx.spec, ctx.ranges[ctx.virtual_stage(st.stage, c)], ctx.init, ctx.d, ctx.device,
                                   ctx.compute_dtype, tp, ctx.experts_of(st.replica)));
    auto& chunk = *st.chunks.back();
    chunk.set_recompute(parse_recompute(ctx.cfg.recompute));
    chunk.set_residual_dtype(ctx.residual_dtype);
    chunk.set_aux_loss_scale(double(ctx.mbs) / ctx.cfg.global_batch);  // (experts)
    if (!params.empty())
      chunk.set_params(from_rank_order(params.at(c), ctx.buckets_of(chunk), ctx.groups_of(st.replica, chunk)));
  }
}

/// Expert parallelism: the chunks compute their share of the experts for the tokens of
/// the group (`experts`: the forwards' all-to-alls, `experts_backward`: the backwards').
void join_expert_groups(stage_state& st, const std::shared_ptr<transport::communicator>& experts,
                        const std::shared_ptr<transport::communicator>& experts_backward) {
  const auto& ctx = *st.ctx;
  const int first = st.replica - experts->rank(), last = first + experts->size() - 1;
  auto label = [&](const char* pass) {
    return fmt::format("expert-parallel group of replicas {}-{}, stage {} ({})", first, last, st.stage, pass);
  };
  auto* state = &st;
  expert_parallel ep{experts->rank(), experts->size(),
                     as_collective_group(experts, nullptr, group_observer(state, [] { return false; }),
                                         group_entry(st, label("forwards"), first, experts->size()),
                                         ctx.launch.all_to_all_delay),
                     as_collective_group(experts_backward, nullptr, group_observer(state, [] { return true; }),
                                         group_entry(st, label("backwards"), first, experts->size()),
                                         ctx.launch.all_to_all_delay)};
  for (auto& chunk : st.chunks) chunk->set_expert_parallel(ep);
  st.ep_size = experts->size();
}

/// Checkpoint folders: replica 0's stages write their own files into the step's
/// temporary folder (no process gathers the whole model): the parameters, and the
/// optimizer state assembled from the stage's shards, whose fp32 main parameters
/// stand for the rounded ones in bf16 jobs. Tensor or expert parallelism: replica 0's
/// rank 0 writes, with the parts of its stage's other ranks (their stage actors' and
/// shards') put together: the files hold whole parameters, as without it.
caf::result<stage_checkpoint> write_stage_checkpoint(stage_self self,
                                                     const write_checkpoint& msg) {
  const auto& ctx = self->state.ctx;
  const auto& wiring = self->state.wiring;
  auto& s = self->state;
  auto rp = self->make_response_promise<stage_checkpoint>();
  // Trace events on this stage's track (step: the one whose checkpoint it is).
  auto gathered = std::make_shared<trace_event>(
      trace_event{"checkpoint gather", s.replica, s.stage, -1, -1, msg.step - 1, ctx->now_us(), 0, 0});
  const int t = ctx->t;
  auto parts = std::make_shared<std::vector<std::map<std::string, torch::Tensor>>>(t);  // by rank: shaped
  auto moments = std::make_shared<std::vector<named_moments>>(t);                       // by rank: flat
  // The stage's parameters in model order (shared copies left out), with their shapes
  // (the experts of other shares: held by pipelines 1 .. EP - 1, shapes unused).
  std::vector<std::pair<std::string, std::vector<std::int64_t>>> names;
  for (auto& c : s.chunks)
    for (const auto& name : slice_parameter_names(ctx->spec, c->range())) {
      const auto& entries = c->entries();
      const auto e = std::find_if(entries.begin(), entries.end(), [&](const auto& x) { return x.name == name; });
      if (e == entries.end() ? expert_of(name) >= 0 : !e->shared_copy)
        names.emplace_back(name, e == entries.end() ? std::vector<std::int64_t>{} : e->shape);
    }
  // bf16 without tensor or expert parallelism: the shards' fp32 main parameters are
  // what is written, so the rounded ones are not copied (use_main_params replaces each).
  const bool from_shards = ctx->compute_dtype != torch::kFloat32 && t == 1 && ctx->ep == 1;
  // The other pipelines holding parts of this stage: replica 0's tensor-parallel
  // ranks, and the pipelines holding the other shares of the experts.
  const int holders = std::max(t, ctx->ep);
  if (!from_shards)
    for (auto& c : s.chunks)
      for (auto& [name, p] : c->state()) (*parts)[0].emplace(name, std::move(p));
  auto fail_with = [=](const std::string& what) {
    return [=](std::size_t, caf::error& err) mutable {
      rp.deliver(stage_checkpoint{{}, what + ": " + self->system().render(err), {}});
      return false;
    };
  };
  auto write = [=, stage = s.stage]() mutable {
    gathered->end_us = ctx->now_us();
    stage_checkpoint out;
    out.events.push_back(*gathered);
    auto written = *gathered;
    written.name = "checkpoint write";
    written.start_us = ctx->now_us();
    try {
      state_dict params;
      named_moments whole;
      if (t == 1) {
        for (const auto& [name, shape] : names)
          params.emplace_back(name, from_shards ? torch::zeros({}).expand(shape) : parts->front().at(name));
        whole = std::move(moments->front());
      } else {
        const auto joined = unshard_by_name(ctx->spec, {}, *parts);
        for (const auto& [name, shape] : names) params.emplace_back(name, joined.at(name));
        whole = unshard_moments(ctx->spec, params, *moments);
      }
      use_main_params(params, whole);
      for (const auto& f :
           write_stage_files(msg.folder, stage, params, optimizer_state_dict(whole, params, msg.step)))
        out.files.push_back({f.name, f.stage, f.kind, f.bytes, f.crc32});
    } catch (const std::exception& e) {
      out.error = e.what();
    }
    written.end_us = ctx->now_us();
    written.bytes = 0;
    for (const auto& f : out.files) written.bytes += std::int64_t(f.bytes);
    out.events.push_back(written);
    rp.deliver(std::move(out));
  };
  auto fetch_moments = [=, stage = s.stage]() mutable {
    request_all<shard_moments>(
        self, wiring->shards[stage], std::chrono::seconds(60),  // [pipeline]
        [=](std::size_t i, shard_moments& rep) {
          gathered->bytes += add_shard_moments(*moments, ctx->tp_of(int(i)), rep);
        },
        write, fail_with("no optimizer state from a shard"), state_atom_v);
  };
  if (holders == 1) {
    fetch_moments();
    return rp;
  }
  std::vector<stage_actor> peers;  // pipelines 1 .. holders - 1
  for (int q = 1; q < holders; ++q) peers.push_back(wiring->stages[q][s.stage]);
  request_all<state_reply>(
      self, peers, std::chrono::seconds(60),
      [=](std::size_t i, state_reply& rep) { add_stage_state(*parts, ctx->tp_of(int(i) + 1), rep); },
      fetch_moments, fail_with("no parameters from a tensor- or expert-parallel rank"), state_atom_v);
  return rp;
}

stage_actor::behavior_type stage_behavior(stage_self self, std::shared_ptr<const runtime_context> ctx,
                                          std::shared_ptr<const job_wiring> wiring, int replica, int stage,
                                          std::vector<torch::Tensor> params,
                                          std::shared_ptr<transport::communicator> experts,
                                          std::shared_ptr<transport::communicator> experts_backward,
                                          std::shared_ptr<transport::communicator> tensors) {
  auto& st = self->state;
  st.ctx = ctx;
  st.wiring = wiring;
  st.replica = replica;
  st.stage = stage;
  st.name = ctx->stage_name(replica, stage);
  st.generation = wiring->generation;
  const auto tp = join_tensor_group(st, tensors);
  make_chunks(st, tp, params);
  if (experts) join_expert_groups(st, experts, experts_backward);
  if (!ctx->dataflow) st.order = &ctx->sched.ranks[stage];
  if (st.order)
    for (const auto& op : *st.order)
      if (op.split) st.split_keys.insert({op.mb, op.chunk});
  // Ops per chunk: counted in the fixed order, or m F's and B's (and W's) each.
  st.chunk_ops.assign(ctx->v, (ctx->split_backward ? 3 : 2) * ctx->m);
  if (st.order) {
    st.chunk_ops.assign(ctx->v, 0);
    for (const auto& op : *st.order) ++st.chunk_ops.at(op.chunk);
  }
  st.total_ops = std::accumulate(st.chunk_ops.begin(), st.chunk_ops.end(), 0);
  st.faults = fault_injector(ctx->faults);
  // An exception ends the actor with its message as the exit reason (the supervisor
  // reports it to the coordinator, which aborts the step).
  self->set_exception_handler([](caf::scheduled_actor*, std::exception_ptr& eptr) { return error_from_exception(eptr); });
  auto logic = std::make_shared<stage_logic>(self);
  // The gradient buckets' watches, made on the actor's own thread once its CUDA stream is
  // current: they hold the parameters' gradient accumulators, which keep the stream
  // current when they were made and accumulate on it.
  auto make_watches = [self, logic, ctx] {
    auto& s = self->state;
    for (int c = 0; c < ctx->v; ++c) {
      auto& slice = *s.chunks[c];
      auto watch = std::make_unique<grad_ready_watch>(slice, ctx->buckets_of(slice),
                                                      [logic, c](int b) { logic->bucket_ready(c, b); });
      std::vector<char> tied(watch->buckets().size(), 0), summed(watch->buckets().size(), 0);
      const auto& entries = slice.entries();
      for (std::size_t i = 0; i < entries.size(); ++i) {
        if (entries[i].name == ctx->tied_name)
          for (int b : watch->buckets_holding(i)) tied[b] = 1;
        if (s.sums_replicated() && s.summed_over_tp(entries[i]))
          for (int b : watch->buckets_holding(i)) summed[b] = 1;
      }
      s.tied_bucket.push_back(std::move(tied));
      s.replicated_bucket.push_back(std::move(summed));
      s.held.emplace_back();
      s.watches.push_back(std::move(watch));
    }
  };
  const auto act_shape = [ctx](int x) { return ctx->activation_shape(x); };
  return {
      [=](const begin_step& msg) {
        auto& s = self->state;
        s.attempt = msg.attempt;
        // Every stage of the node sees this begin_step; one of them logs and kills.
        static std::atomic_flag killing = ATOMIC_FLAG_INIT;
        if (s.faults.kills_node(wiring->node, msg.step, msg.attempt) && !killing.test_and_set()) {
          spdlog::warn("fault injected: node {} kills its own process (SIGKILL) as step {} (index {}) begins",
                       wiring->node, msg.step + 1,
                       msg.step);
          spdlog::default_logger()->flush();
          ::kill(::getpid(), SIGKILL);
        }
        if (ctx->cfg.threads > 0) torch::set_num_threads(ctx->cfg.threads);
        if (!s.stream_set) {  // a detached actor: this thread is its own from now on
          use_own_stream(ctx->device);
          s.stream_set = true;
          make_watches();
          if (ctx->device.is_cuda()) s.gpu_clock = std::make_unique<gpu_op_clock>(ctx->device);
        }
        // The stream's last step (its parameters' copy) is done by now: one wait per step.
        if (s.gpu_clock) {
          s.gpu_clock->anchor([&] { return ctx->now_us(); });
          s.gpu_spans.clear();
        }
        s.step = msg.step;
        s.running = true;
        s.next_op = 0;
        s.ops_done = 0;
        s.forwards_done = 0;
        s.chunk_ops_left = s.chunk_ops;
        s.params_received = 0;
        {
          std::lock_guard<std::mutex> lock(s.sent_mutex);
          s.sent.clear();
        }
        s.last_op.reset();
        s.done_reported = false;
        auto stash = std::move(s.stash);
        s.stash.clear();
        for (auto& m : stash) caf::anon_send(caf::actor_cast<caf::actor>(self), std::move(m));  // in order, as they came
        logic->run_ready();
      },
      [=](microbatch_input& msg) {
        if (!logic->accept(msg.step) || !logic->first_time(received::input, {msg.mb, 0}, "micro-batch input")) return;
        auto& s = self->state;
        const auto problem = check_payload(msg.data, ctx->input_shape(), ctx->input_dtype());
        if (!problem.empty()) return logic->fail("micro-batch input " + std::to_string(msg.mb) + ": " + problem);
        s.inputs[{msg.mb, 0}] = tensor_of(msg.data).to(ctx->device);
        logic->run_ready();
      },
      [=](microbatch_target& msg) {
        if (!logic->accept(msg.step) || !logic->first_time(received::target, {msg.mb, 0}, "micro-batch target")) return;
        self->state.targets[msg.mb] = tensor_of(msg.data).to(ctx->device);
        logic->run_ready();
      },
      [=](forward_activation& msg) {
        if (!logic->fetched(msg)) return;
        // An activation entering virtual stage x has the shape of x's input.
        const int x = self->state.virtual_of(msg.chunk);
        logic->receive(self->state.inputs, msg.step, msg.mb, msg.chunk, msg.data, act_shape(x), "activation");
      },
      [=](backward_grad& msg) {
        if (!logic->fetched(msg)) return;
        // The gradient of x's output has the shape of x + 1's input.
        const int x = self->state.virtual_of(msg.chunk);
        logic->receive(self->state.out_grads, msg.step, msg.mb, msg.chunk, msg.data, act_shape(x + 1), "gradient");
      },
      [=](tied_grad& msg) {
        if (!logic->fetched(msg)) return;
        if (!logic->accept(msg.step) || !logic->first_time(received::tied_gradient, {0, 0}, "tied gradient")) return;
        const auto problem = check_payload(msg.data, logic->tied_slice().param(ctx->tied_name).sizes(), torch::kFloat32);
        if (!problem.empty()) return logic->fail("tied embedding gradient: " + problem);
        auto tied = tensor_of(msg.data).to(ctx->device);
        logic->trace_comm("recv", "tied gradient", -1, -1, ctx->now_us(), payload_bytes(msg.data));
        logic->on_tied(std::move(tied));
      },
      [=](param_shard& msg) {
        if (!logic->accept(msg.step) || !logic->first_time(received::parameters, {msg.chunk, 0}, "parameter buffer")) return;
        logic->on_params(msg);
      },
      [=](eval_activation& msg) {
        if (!logic->fetched(msg)) return;
        logic->on_eval_activation(msg);
      },
      [=](const eval_target& msg) { logic->on_eval_target(msg); },
      [=](eval_atom, std::int64_t) -> std::vector<trace_event> {  // the evaluation is over: its ops
        auto events = std::move(self->state.eval_events);
        self->state.eval_events.clear();
        return events;
      },
      [=](run_atom) {  // dataflow: a W's turn (asked by run_ready)
        self->state.turn_asked = false;
        logic->run_ready(/*weight_turn=*/true);
      },
      [=](const reset_step&) -> reset_report { return logic->reset(); },
      [=](wait_atom, std::int64_t step) -> wait_report { return logic->waits(step); },
      [=](const abort_step& msg) {
        logic->reset();
        self->state.step = msg.step;
      },
      [=](state_atom) -> state_reply {
        state_reply rep;
        for (auto& c : self->state.chunks)
          for (auto& [name, t] : c->state()) {
            rep.names.push_back(name);
            rep.tensors.push_back(make_payload(t));
          }
        return rep;
      },
      [=](const write_checkpoint& msg) { return write_stage_checkpoint(self, msg); },
      [=](plant_atom) {  // tests: a stray buffered tensor the next reset must report
        self->state.inputs[{-1, -1}] = torch::zeros({1});
      },
  };
}

}  // namespace

stage_actor spawn_stage_actor(caf::local_actor* supervisor, std::shared_ptr<const runtime_context> ctx,
                             std::shared_ptr<const job_wiring> wiring, int replica, int stage,
                             std::vector<torch::Tensor> params, std::shared_ptr<transport::communicator> experts,
                             std::shared_ptr<transport::communicator> experts_backward,
                             std::shared_ptr<transport::communicator> tensors) {
  // Detached: a thread of its own, so its LibTorch intra-op thread count is its own
  // and long compute never holds a scheduler thread other actors need.
  return supervisor->spawn<caf::detached + caf::monitored>(stage_behavior, std::move(ctx), std::move(wiring),
                                                          replica, stage, std::move(params), std::move(experts),
                                                          std::move(experts_backward), std::move(tensors));
}

}  // namespace troupe
