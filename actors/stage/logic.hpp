#pragma once
// The stage actor's state and logic, in four files: actors/stage/stage.cpp (its behavior: the
// messages it takes, its groups, its checkpoints), actors/stage/ops.cpp (a step's ops: which
// runs next, forward, backward and weight passes, overlapped pairs, gradient buckets, the
// tied embedding, the parameters from the shards), actors/stage/protocol.cpp (a step's
// messages: reset, acceptance, duplicates, what it waits for) and actors/stage/evaluation.cpp
// (forward-only evaluation between steps). Only these files include it.
#include "actors/stage/stage.hpp"

#include <algorithm>
#include <limits>
#include <numeric>
#include <future>
#include <map>
#include <optional>
#include <mutex>
#include <set>
#include <thread>

#include <caf/all.hpp>
#include <torch/torch.h>

#include "actors/activity_board.hpp"
#include "actors/request_all.hpp"
#include "actors/tp_groups.hpp"
#include "compute/checkpoint/checkpoint_dir.hpp"
#include "compute/runtime/device.hpp"
#include "compute/optim/grad_buffer.hpp"
#include "compute/optim/fsdp.hpp"
#include "compute/parallel/tensor_parallel.hpp"
#include "compute/models/tensor_parallel_layout.hpp"
#include "compute/trainer/local_trainer.hpp"
#include "messages/type_ids.hpp"

namespace troupe::stage_detail {

using key = std::pair<int, int>;  // (micro-batch, chunk)

// The wait-for graph's names of a stage's messages (the sender's and the receiver's).
inline std::string activation_text(int mb, int chunk) {
  return "activation mb " + std::to_string(mb) + " chunk " + std::to_string(chunk);
}
inline std::string gradient_text(int mb, int chunk) {
  return "gradient mb " + std::to_string(mb) + " chunk " + std::to_string(chunk);
}
inline std::string bucket_text(int chunk, int b) {
  if (b < 0) return "reduced gradients of chunk " + std::to_string(chunk);  // (FSDP: all buckets at once)
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
  std::map<int, torch::Tensor> positions;  // documents: each micro-batch's, as its input or activation brought them
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
  /// Gradients or parameters sharded (ctx->shards_grads()): per chunk its FSDP part, and
  /// the data-parallel group the ops' collectives run in.
  storage_pool fsdp_pool;  // their buffers' memory between ops of a step (cleared once its ops are done)
  std::vector<sharded_slice> sharded;
  std::shared_ptr<collective_group> dp_group;
  std::shared_ptr<collective_group> edp_group;  // (expert parallelism: the expert regions')
  /// FSDP with the tied embedding: per chunk holding a copy, that copy's gradient, taken
  /// out of each run's reduction and summed over the step (fp32, whole); with the other
  /// copy's added it is reduced once the step's ops ran (reduce_tied_chunk). Undefined
  /// for the other chunks.
  std::vector<torch::Tensor> fsdp_tied;
  /// FSDP by blocks (ctx->fsdp_blocks()): per chunk the hooks its blocks' forwards and
  /// backwards call (fsdp_block_hooks).
  std::vector<std::unique_ptr<model_slice::block_hooks>> fsdp_hooks;
  bool fsdp_split = false;  // the op computing is a split backward (its blocks' gradients wait for the run's end)
  torch::Tensor* tied_sum(int chunk) {
    return std::size_t(chunk) < fsdp_tied.size() && fsdp_tied[std::size_t(chunk)].defined()
               ? &fsdp_tied[std::size_t(chunk)]
               : nullptr;
  }
  int cp_size = 1;  // context parallelism: the size of the stage's context-parallel group
  std::shared_ptr<collective_group> cp_group;  // (cp_size > 1)
  /// The stage actors that run the same forwards and backwards in one order, meeting in
  /// their collectives (an expert-parallel or a tensor-parallel group; 1: none).
  /// The pipelines that evaluate together: the whole replicas an expert-parallel group
  /// spans (EP consecutive pipelines, tensor-parallel rank fastest), lcm(EP, T); with
  /// context parallelism the T C pipelines of a replica (lcm(EP, T C)).
  int group_size() const { return ep_size / std::gcd(ep_size, tp_size * cp_size) * tp_size * cp_size; }
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
  /// replica's ranks (each holds part of the vocabulary), with context parallelism each of
  /// its ranks (each scores its tokens; the group's score is the mean of theirs).
  bool scores_evaluation() const { return replica % group_size() < tp_size * cp_size; }
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

/// FSDP by blocks: a chunk's block gathered before its forward and again before its
/// backward (the next block's gather started as it computes), released after each; its
/// gradients made before its backward and reduce-scattered after it (a split backward's:
/// when the run of the chunk's ops ends). The stage's thread runs them, inside the op
/// (the backward's on LibTorch's autograd engine, from the stage's thread).
class fsdp_block_hooks final : public model_slice::block_hooks {
 public:
  fsdp_block_hooks(stage_state& s, int chunk) : s_(s), chunk_(chunk) {}
  void before(int block, bool backward) override;
  void after(int block, bool backward) override;

 private:
  stage_state& s_;
  int chunk_;
};

/// Sequence parallelism: the gradients of the parameters every rank holds whole (within
/// `within`, or all), summed over the tensor-parallel group (one all-reduce of them all;
/// every rank calls it in the same place of the same op order).
void sum_replicated(stage_state& s, model_slice& slice, const fsdp_unit* within = nullptr);

/// Megatron's deallocate_output_tensor: the output's data goes (the receiver holds its
/// own reference), its autograd node stays for the backward.
inline void deallocate(torch::Tensor& out) { out.set_data(torch::empty({1}, out.options())); }

using stage_self = stage_actor::stateful_pointer<stage_state>;

class stage_logic {
 public:
  stage_logic(stage_self self) : self_(self), s_(self->state) {}

  bool ready(const pipeline_op& op) const;

  /// Runs every op that can run now. Dataflow with a split backward runs a W when no F
  /// or B can run and the W is due (`weight_due`), one per turn (`weight_turn`): between
  /// two W's the mailbox is read, so an activation or gradient that arrived meanwhile
  /// goes first.
  void run_ready(bool weight_turn = false);

  /// A loader's input or target (or an evaluation's, from the loader) on the job's
  /// device, queued on the stage's stream without waiting for it (to_device_async); a
  /// plain `.to()` when the launcher asks (launch_info::blocking_input_copies, the
  /// benchmark's A/B).
  torch::Tensor to_device(const torch::Tensor& host) const {
    return s_.ctx->launch.blocking_input_copies ? host.to(s_.ctx->device) : to_device_async(host, s_.ctx->device);
  }

  /// FSDP with parameters (parallel.fsdp_prefetch): starts the all-gather of the chunk of
  /// op `i` of the order (none where it is held, or op i is a weight pass), one op ahead
  /// of it: it runs while the stage computes op i - 1 or, for op 0 (at begin_step), waits
  /// for its first input. The replicas start it at the same place of the same order.
  void prefetch(std::size_t i);

  /// The last stage's losses of this step, read from the device once (one host sync).
  /// (Tensor parallelism: the group's rank 0; every rank computed the same losses.)
  void report_losses();

  /// Fault injection, once: the first report of `target` (a loss report, an evaluation
  /// result) of the faulty step, on its way to `to` (the supervisor, the coordinator), is
  /// dropped, duplicated or delayed. True when it was taken care of (dropped or delayed),
  /// false when it is still to be sent.
  template <class Handle, class Report>
  bool report_fault(const Handle& to, message_target target, const char* what, const Report& rep) {
    const auto fault = s_.faults.take_message(s_.replica, s_.stage, s_.step, s_.attempt, target);
    if (!fault) return false;
    spdlog::warn("fault injected: {} {}s its first {} of step {} (index {})", s_.name, name(fault->action), what,
                 s_.step + 1, s_.step);
    if (fault->action == message_action::duplicate) self_->send(to, rep);
    if (fault->action == message_action::delay) self_->delayed_send(to, delay_of(*fault), rep);
    return fault->action == message_action::drop || fault->action == message_action::delay;
  }

  static std::chrono::microseconds delay_of(const message_fault& f);

  std::optional<pipeline_op> next_dataflow_op() const;

  int in_flight_bound() const { return s_.ctx->cfg.max_in_flight > 0 ? s_.ctx->cfg.max_in_flight : s_.ctx->p; }

  /// Dataflow: a W is due when the next forward waits for one (the in-flight bound is
  /// reached) or when this stage has no forward left in the step (its cool-down, where it
  /// would idle while the last backwards travel back). Not in the gaps between a stage's
  /// F's and B's: those are shorter than a W, and a W started there delays the F or B
  /// that arrives during it. (Measured, p=2 on 2 cores, 1f1b's step time over this
  /// one's: with a W in every gap 0.88 and 0.93 at 4 micro-batches, 1.00 and 0.95 at 8;
  /// with this rule 0.94-1.07 and 0.99-1.02, zero-bubble's range.)
  bool weight_due() const;

  /// Dataflow's next W: the lowest micro-batch whose B has run.
  std::optional<pipeline_op> next_weight_op() const;

  /// Fault injection at the step's second op: the stage throws, or its thread blocks (an
  /// actor that stops answering: its mailbox is not read meanwhile).
  void inject_op_faults();

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
    torch::Tensor positions;              // forward: its micro-batch's documents (undefined: none)
    stage_state::saved_t sv;             // backward: the forward's input and output
    torch::Tensor grad;                  // backward: the gradient of its output (not on the last virtual stage)
    double computed_us = -1;             // an overlapped op: when its compute ended
  };

  op_work begin_op(const pipeline_op& op);

  /// The op's compute: its slice (and a split op's W store) only, and the expert
  /// all-to-alls' trace events (under their lock).
  void compute(op_work& w);
  void compute_op(op_work& w, model_slice& slice);  // compute's op itself (FSDP's collectives around it)

  void end_op(op_work& w);

  void push_event(trace_event ev);

  void execute(const pipeline_op& op);

  /// Whether a pair's two ops run at once: asked for (parallel.overlap_pairs), with expert
  /// parallelism (whose all-to-alls they hide behind each other's compute), on the CPU,
  /// without recomputation (a recomputing backward flags its slice, which a forward
  /// beside it would see) and without tensor parallelism (the two ops' collectives on the
  /// one tensor-parallel group would meet in different orders on its ranks). Else one
  /// after the other.
  bool overlaps_pairs() const;

  /// An overlapped pair (combined-1f1b, dualpipev): the backward computes on the stage's
  /// thread while the forward computes on a thread of its own, each calling its own
  /// expert-parallel group's all-to-alls, so that one's wait hides behind the other's
  /// compute. Both inputs are taken first and both results handed on after.
  void execute_pair(const pipeline_op& f, const pipeline_op& b);

  /// A chunk's ops all ran: its gradients are final (but for a tied embedding's, which
  /// the first and last stage sum first). Its buckets not handed over during the last
  /// backward go to the shard now, while the stage runs the other chunks' backwards
  /// (interleaved schedules: Megatron's overlap of a model chunk's gradient reduction
  /// with the rest of the backward).
  void chunk_done(int chunk);

  /// All ops ran (every chunk's buffer is with the shard or waits for the tied gradient).
  void after_backward();

  model_slice& tied_slice() { return *s_.chunks.at(s_.tied_chunk()); }

  void on_tied(torch::Tensor other);
  /// This stage's copy of the tied embedding's gradient to the other copy's stage.
  void send_tied(const torch::Tensor& mine);
  /// FSDP: the other stage's copy's gradient added to this one's, reduced into the tied
  /// chunk's pieces (reduce_tied_chunk).
  void reduce_tied(const torch::Tensor& other);
  /// FSDP: `sum` (the copies' summed gradient) reduce-scattered into `chunk`'s pieces
  /// over the buckets holding the tied embedding, and the chunk's pieces to the shard.
  void reduce_tied_chunk(int chunk, const torch::Tensor& sum);
  /// FSDP: a chunk's reduced pieces of the step to its shard.
  void send_reduced(int chunk);

  /// A watch reported bucket `b` of `chunk` final: to the shard, or held for the tied sum.
  /// (With CUDA this runs on LibTorch's autograd thread while the actor's thread waits
  /// for its backward.)
  void bucket_ready(int chunk, int b);

  void send_held(int chunk);

  /// Hands bucket `b` of a chunk's grad buffer to this replica's shard of the stage (same
  /// process; the message carries the whole buffer). anon_send: it may run on another
  /// thread than the actor's (see bucket_ready).
  void send_bucket(int chunk, int b);

  void on_params(const param_shard& msg);

  /// Drops per-step state; returns what was left over that should not have been.
  reset_report reset();

  /// True if a message of step `step` may be handled now; stashes later steps' messages.
  bool accept(std::int64_t step);

  /// Buffers a received activation or gradient after checking it, then runs what is ready.
  /// An activation's document positions (`positions`, optional) are kept for its micro-batch.
  void receive(std::map<key, torch::Tensor>& into, std::int64_t step, int mb, int chunk, const tensor_payload& data,
               const std::vector<std::int64_t>& shape, const char* what, const tensor_payload* positions = nullptr);
  /// Checks a micro-batch's document positions (empty: none; else (rows, seq_len) int64)
  /// and returns them on the CPU (undefined when empty); "" or the problem in `problem`.
  torch::Tensor positions_of(const tensor_payload& p, std::int64_t rows, std::string& problem) const;

  /// A send ("send <what>": the time the send took on this actor, the hand-off or the
  /// start of a transfer) or receive ("recv <what>": when it was accepted) trace event,
  /// with the tensor's bytes.
  void trace_comm(const char* dir, const char* what, int mb, int chunk, double start_us, std::int64_t bytes);

  /// False (and a warning) for a second copy of a tensor message of this step: a
  /// duplicate is dropped, never applied twice.
  bool first_time(received kind, key k, const char* what);

  void fail(const std::string& what);

  // --- the wait-for graph (hang diagnosis) ---

  static stage_state::sent_message sent_of(const forward_activation& m, int to);
  static stage_state::sent_message sent_of(const backward_grad& m, int to);
  static stage_state::sent_message sent_of(const tied_grad&, int to);

  /// What this stage waits for in `step`, from whom, and what it sent.
  wait_report waits(std::int64_t step);

  /// The op this running stage cannot run for want of a message: in a fixed order the
  /// next one; in dataflow the lowest micro-batch's backward waiting for its gradient,
  /// else the next forward waiting for its input.
  std::optional<pipeline_op> next_blocked_op() const;

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
  bool eval_accepts(std::int64_t step, const char* what);

  /// Checks an evaluation activation and runs it (expert parallelism: in its turn).
  void on_eval_activation(const eval_activation& msg);

  /// Runs evaluation forward `msg.index` through chunk `msg.chunk` (no autograd, the
  /// training forward's precision), then hands the activation on, or keeps the last
  /// virtual stage's output to score once its targets are here.
  void run_eval_forward(const eval_activation& msg);

  void on_eval_target(const eval_target& msg);

  /// Last stage: scores forward `index` once its output and its targets are both here
  /// (tensor parallelism: the group's forwards in order).
  void score_eval(int index);

  void score_eval_now(int index);

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

}  // namespace troupe::stage_detail
