#pragma once
// The actor runtime in one process: a coordinator, a supervisor, and per replica a data
// loader and p stage actors, per stage d optimizer shard actors.
//
//   coordinator --begin_step--> each node's supervisor --> its loaders, stages, shards
//   loader --microbatch_input--> stage 0      loader --microbatch_target--> stage p-1
//   stage k --forward_activation--> stage k+1 --...--> last: loss_report --> coordinator
//   stage k <--backward_grad-- stage k+1;  first <--tied_grad--> last
//   stage --grad_shard (its grad buffer)--> its own shard; the stage's d shards
//     reduce-scatter through their transport::communicator
//   shard --grad_norm_partial--> coordinator --clip_factor_msg--> shards
//   shards update, all-gather through the communicator; shard --param_shard--> its own
//   stage --stage_done--> coordinator
//   coordinator commits, then supervisor resets every actor and checks what it still held
// The reports "--> coordinator" go through the actor's supervisor, which sends them on
// batched (step_reports); the clip factor goes through the supervisors too.
#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <caf/actor.hpp>
#include <caf/error.hpp>

#include "actors/payload.hpp"
#include "actors/trace.hpp"
#include "actors/launch_info.hpp"
#include "compute/config/fault_plan.hpp"
#include "compute/optim/grad_buffer.hpp"
#include "compute/config/job_config.hpp"
#include "compute/models/model.hpp"
#include "compute/models/partition.hpp"
#include "compute/schedule/schedule.hpp"
#include "compute/trainer/local_trainer.hpp"
#include "messages/interfaces.hpp"
#include "compute/optim/fsdp.hpp"
#include "messages/step_messages.hpp"
#include "transport/transport.hpp"

namespace troupe {

struct simulated_costs;  // actors/simulated/costs.hpp

/// What every actor of a job knows; immutable once the job starts.
struct runtime_context {
  /// `clock`: the timeline of trace events (nodes of a job: the coordinator's, see
  /// job_clock); none: this process's steady clock from now. `slots`: a node process that
  /// runs only these stages ((replica, stage) pairs) keeps of the initial or resumed
  /// parameters and moments only what their slices take (keep_only); a checkpoint folder
  /// it resumes is read so, file by file, never whole. None: the whole model.
  /// `launch`: what the launcher said besides the configuration (a restart, benchmark
  /// hooks). A restart's newest checkpoint (launch.resume_auto) is the caller's to resolve
  /// (resolve_resume; node 0 does it once for every node); a root or "auto" left in
  /// `c.resume` becomes its step folder here.
  explicit runtime_context(const job_config& c, std::shared_ptr<const job_clock> clock = nullptr,
                           const std::optional<std::vector<std::pair<int, int>>>& slots = std::nullopt,
                           const launch_info& launch = {});

  job_config cfg;
  model_spec spec;
  std::string tied_name;             ///< tied_parameter(spec): "" when the decoder is untied
  int p, d, m, v, mbs;
  /// Micro-batches a data loader sends at a step's begin (parallel.credit_window; 0: all
  /// m, and no credits); each credit of stage 0 for micro-batch k asks for k + ahead.
  int ahead;
  /// Tensor parallelism (parallel.tensor_parallel): each replica is `t` pipelines, one per
  /// tensor-parallel rank, whose stage actors of a stage meet in their group's
  /// collectives. The runtime's pipelines ("replica" indices of stages, loaders and
  /// shards) are numbered as Megatron numbers ranks, tensor-parallel fastest: pipeline
  /// q = dp t + tp. `d` stays the data-parallel width (the shards' groups, the data's
  /// blocks); `pipes` = d t. Without tensor parallelism a pipeline is a replica.
  int t = 1, pipes = 1;
  bool sequence_parallel = false;
  int dp_of(int pipe) const { return pipe / t; }
  int tp_of(int pipe) const { return pipe % t; }
  /// Context parallelism (parallel.context_parallel): each data-parallel replica is `c`
  /// context-parallel ranks, each holding 1/c of every sequence's tokens (chunks cp and
  /// 2c-1-cp), numbered as Megatron numbers them, tensor-parallel fastest, then
  /// context-parallel: pipeline q = (data c + cp) t + tp. To the shards, the losses and
  /// the checkpoints a context-parallel rank is a replica: `d` = data_parallel x c, and
  /// dp_of(q) = data c + cp (the gradients are averaged over the data-parallel x
  /// context-parallel group, as Megatron does). The data's blocks are data_of(q)'s.
  int c = 1;
  cp_comm cp_kind = cp_comm::p2p;
  int data_of(int pipe) const { return dp_of(pipe) / c; }
  int cp_of(int pipe) const { return dp_of(pipe) % c; }
  /// A micro-batch's loss's weight in the step's (its share of the tokens): micro-batch
  /// size / (global batch x c).
  double loss_weight() const { return double(mbs) / (double(cfg.global_batch) * c); }
  /// Expert parallelism (parallel.expert_parallel): pipelines EP g .. EP g + EP - 1 are an
  /// expert-parallel group; pipeline q holds share q mod EP of each expert layer's experts,
  /// and its shards shard them over the `edp` = d t / EP pipelines holding the same share
  /// (its expert-data-parallel group, rank q / EP).
  int ep = 1, edp = 1;
  expert_share experts_of(int pipe) const {
    return ep > 1 ? expert_share{pipe % ep, ep, edp} : expert_share{};
  }
  /// The groups shard `pipe`'s buffer of a chunk laid out as `slice` is reduced over.
  shard_groups groups_of(int pipe, const model_slice& slice) const {
    return {g, dp_of(pipe) % g, slice.expert_offset(), eg, expert_shard_rank(pipe)};
  }
  /// Hybrid sharding (parallel.shard_group): the data-parallel group's d ranks as d / g
  /// shard groups of g consecutive ranks (g = d: one group). Shard `pipe` owns piece
  /// dp mod g of its group's state; the shards of the same piece in the other groups
  /// hold the same bits (their communicator: transport/hybrid.hpp).
  int g = 1;
  /// Which of the d / g copies of its piece shard `pipe` holds (0: the one whose
  /// gradient-norm partials count).
  int shard_copy_of(int pipe) const { return dp_of(pipe) / g; }
  /// With experts: the expert-data-parallel group's edp ranks as edp / eg groups of
  /// eg = g t / EP consecutive ranks (eg = edp without hybrid sharding). A data-parallel
  /// shard group's g t pipelines hold whole expert-parallel groups (EP divides g t), so
  /// it holds the whole state: the dense region sharded g ways, each share of the
  /// experts eg ways. Copy shard_copy_of(pipe) of both.
  int eg = 1;
  int expert_shard_rank(int pipe) const { return ep > 1 ? (pipe / ep) % eg : 0; }
  /// What the data-parallel group shards (parallel.shard): with gradients or parameters
  /// the stage actors reduce-scatter their chunks' gradients (and with parameters
  /// all-gather their parameters) around each run of ops on a chunk, over their shards'
  /// communicator themselves (compute/optim/fsdp.hpp); the shards get the reduced pieces.
  shard_level shard = shard_level::optimizer;
  bool shards_grads() const { return shard != shard_level::optimizer; }
  bool shards_params() const { return shard == shard_level::parameters; }
  /// FSDP by blocks (parallel.fsdp_unit): each block of a chunk a unit of its own, gathered
  /// for its forward and again for its backward, its gradients reduced as its backward ends.
  bool fsdp_blocks() const { return shards_grads() && cfg.fsdp_unit == "block"; }
  int n_virtual;
  bool dataflow;                     ///< no fixed order (schedule = "dataflow")
  schedule sched;                    ///< fixed-order kinds (for dataflow: 1f1b, unused)
  bool split_backward;               ///< B and W ops (zero-bubble; dataflow with split_backward)
  std::vector<layer_range> ranges;   ///< by virtual stage
  /// Placement (schedule.hpp): the virtual stage chunk `chunk` of stage `stage` runs, the
  /// (stage, chunk) of virtual stage x, and the stage computing the loss (p - 1; stage 0
  /// for the V kinds).
  int virtual_stage(int stage, int chunk) const { return sched.virtual_stage(stage, chunk); }
  std::pair<int, int> place(int x) const { return sched.place(x); }
  int loss_stage() const { return place(n_virtual - 1).first; }
  /// train.compute = "simulated": the modelled times of every op, collective and transfer;
  /// the stages and shards are actors/simulated/'s and `init` stays empty (null: real).
  std::shared_ptr<const simulated_costs> simulated;
  torch::Device device{torch::kCPU}; ///< where stages and shards compute (train.device)
  torch::ScalarType compute_dtype = torch::kFloat32;  ///< train.precision
  /// The decoders' residual stream (train.fp32_residual): fp32, or compute_dtype (bf16
  /// decoders by default; fp32 for the MLP). What a stage widens a received activation or
  /// gradient to.
  torch::ScalarType residual_dtype = torch::kFloat32;
  /// The initial parameters (or the resumed ones): the whole model's, a node process's
  /// stages' after keep_only. Actors take them with take_init; once every stage and shard
  /// this process starts with has, only their names and shapes stay (tensors on the meta
  /// device, no storage): the parameters then live in the actors alone (with parameters
  /// sharded, in the shards alone), and an actor made later (an in-place retry, a rejoin)
  /// takes its values from the snapshots.
  mutable state_dict init;
  /// `init`'s tensors (shared handles, valid while the caller keeps them) for one of this
  /// process's stages or shards; counts it, and the last of them (slots, or p x pipes of
  /// each without) leaves `init` with shapes only. Taken after that, the tensors are meta:
  /// the caller must take values from elsewhere.
  state_dict take_init() const;
  /// --load / --resume: AdamW moments by name (likewise). Held only while the job starts:
  /// emptied once every shard of this process has restored from it (with_resume_moments).
  mutable std::map<std::string, torch::Tensor> resume_optim;
  /// A shard that starts with the job restores from resume_optim in `restore` (under a
  /// lock); once each of this process's shards has (slots, or p x d without), resume_optim
  /// is emptied: the moments are in the shards, and a shard started later (an in-place
  /// retry, a rejoin) starts from snapshots, not from the checkpoint.
  void with_resume_moments(const std::function<void(const std::map<std::string, torch::Tensor>&)>& restore) const;
  /// A node process that runs only the stages of `slots` ((replica, stage) pairs): keeps
  /// of `init` and `resume_optim` what their slices take (the rest would stay in memory
  /// for the whole run, on every node).
  void keep_only(const std::vector<std::pair<int, int>>& slots);
  /// The names of the parameters the slices of `slots` take.
  std::set<std::string> parameters_of(const std::vector<std::pair<int, int>>& slots) const;
  std::int64_t start_step = 0;       ///< --load / --resume: the checkpoint's next step
  /// What the launcher said: how often it has restarted this job (`launch.attempt`;
  /// injected faults fire in one launch only, faults.attempt, default the first), the
  /// restart's cause for the metrics, and the benchmarks' hooks: every stage's backward on
  /// its own thread (`launch.backward_on_stage_threads`; stages with a group always,
  /// compute/runtime/device.hpp's backward_on_this_thread), to compare on a GPU with LibTorch's
  /// one autograd thread per device; a delay in every all-to-all; a kernel profile.
  launch_info launch;
  /// The [faults] keys, parsed once; empty unless this launch is the one they fire in.
  /// Each actor asks its own fault_injector made from it.
  fault_plan faults;

 private:
  mutable std::mutex resume_mutex_;
  mutable int resume_shards_left_ = 0;  ///< shards yet to restore from resume_optim
  mutable std::mutex init_mutex_;
  mutable int init_users_left_ = 0;  ///< stages and shards yet to take `init`
  mutable bool init_released_ = false;

 public:
  std::shared_ptr<const job_clock> clock;  ///< the timeline of trace events

  double now_us() const { return clock->now_us(); }
  /// Expected shape of the activation entering virtual stage `x` (> 0) and of the
  /// gradient leaving it: of a micro-batch, or (rows >= 0) of that many rows (evaluation).
  std::vector<std::int64_t> activation_shape(int x, std::int64_t rows = -1) const;
  /// Expected shape and dtype of the data entering virtual stage 0 (gpt: token ids; mlp:
  /// images), likewise.
  std::vector<std::int64_t> input_shape(std::int64_t rows = -1) const;
  torch::ScalarType input_dtype() const;
  /// The actors' names, as logs and the wait-for graph give them.
  /// (`replica`, `rank`: a pipeline index; with tensor parallelism the names say its
  /// replica and tensor-parallel rank.)
  std::string stage_name(int replica, int stage) const;
  std::string shard_name(int stage, int rank) const;
  std::string loader_name(int replica) const;
  /// The gradient buckets of a chunk laid out as `slice` (stages and shards agree on
  /// them): parallel.bucket_size's with data parallelism, else one per region
  /// (slice_buckets).
  std::vector<flat_range> buckets_of(const model_slice& slice) const;
};

/// Handles of all actors of the job, filled before the first step (the supervisor's own
/// actors at spawn, the others by the coordinator's wiring_msg).
struct job_wiring {
  coordinator_actor coordinator;
  std::vector<std::vector<stage_actor>> stages;  ///< [pipeline][stage]
  std::vector<std::vector<shard_actor>> shards;  ///< [stage][pipeline]
  std::vector<loader_actor> loaders;             ///< [pipeline]
  /// Several nodes: the node of every stage ([replica][stage]), this node, and the
  /// nodes' world communicator (rank = node) that carries tensors between them.
  std::vector<std::vector<int>> nodes;
  int node = 0;
  std::shared_ptr<transport::communicator> world;
  std::shared_ptr<std::atomic<std::uint32_t>> next_tag = std::make_shared<std::atomic<std::uint32_t>>(1);
  /// In-place recoveries so far (set by the supervisor before it spawns new actors):
  /// failures reported by actors of an older generation are stale.
  std::int32_t generation = 0;
  /// Several nodes, node > 0: the supervisor of the next node (buddy_node), which keeps
  /// copies of this node's optimizer shards (null: no copies).
  supervisor_actor buddy;
  int buddy_node = -1;
  /// This node's supervisor: its actors' step reports (loss, gradient-norm partial,
  /// stage and shard done) go to it, which batches them for the coordinator.
  supervisor_actor supervisor;

  /// True when stage (replica, stage) lives in another process.
  bool remote(int replica, int stage) const { return !nodes.empty() && nodes[replica][stage] != node; }
  void clear() {
    coordinator = nullptr;
    stages.clear();
    shards.clear();
    loaders.clear();
    world = nullptr;
    buddy = nullptr;
    supervisor = nullptr;
  }
};

/// Sends `p`'s tensor to `dst_node` over the wiring's world communicator and returns the
/// payload for the message: metadata and the transport handle, no tensor. A failed send
/// is reported to the coordinator by `who`.
tensor_payload ship_payload(const job_wiring& w, const tensor_payload& p, int dst_node, const std::string& who);

/// Receives a shipped payload's bytes into a tensor on `device`; `done(payload with the
/// tensor, error)` runs on the transport's thread when they are in. `pinned` (a host
/// tensor, a LibTorch with CUDA): page-locked memory from LibTorch's caching host
/// allocator, which a copy from the GPU fills at the bus's speed (into fresh pageable
/// memory gpt-small's shard copies moved at about 1.2 GB/s on an H200).
void fetch_payload(const job_wiring& w, const tensor_payload& p,
                   std::function<void(tensor_payload, const std::string& error)> done,
                   torch::Device device = torch::kCPU, bool pinned = false);

/// Puts the pieces of optimizer state of a shard of tensor-parallel rank `tp` (its
/// checkpoint answer) into by_tp[tp], on the host, and those of experts (whole on every
/// rank, each share's own) into by_tp[0], where unshard_moments takes every parameter
/// every rank holds whole from; returns their bytes.
std::int64_t add_shard_moments(std::vector<named_moments>& by_tp, int tp, const shard_moments& state);
/// Puts the parameters of a stage actor of tensor-parallel rank `tp` (its state_reply)
/// into by_tp likewise, on the host.
void add_stage_state(std::vector<std::map<std::string, torch::Tensor>>& by_tp, int tp, const state_reply& state);

/// Exit status of a run that failed in a way a restart from its last checkpoint can
/// cure (a node or actor lost, a step aborted); the launcher restarts such jobs.
/// (EX_TEMPFAIL of sysexits.h.)
constexpr int exit_recoverable = 75;
/// Exit status of a rejoining node process (not node 0) that could not reach the
/// coordinator (node 0) within its join timeout: node 0 is frozen, cut off or gone. The
/// launcher then ends node 0, and the job restarts. (EX_UNAVAILABLE of sysexits.h.)
constexpr int exit_coordinator_unreachable = 69;

/// Asks the coordinator of this process to stop after the step in progress (with a
/// checkpoint of it). Async-signal-safe: for signal handlers. `signal`: which one, for
/// the log.
void request_stop(int signal) noexcept;
/// The signal of a pending stop request, 0 when there is none.
int stop_requested() noexcept;
/// Asks the coordinator of this process to log the job's wait-for graph (what every actor
/// waits for) without disturbing it (SIGUSR2). Async-signal-safe.
void request_status() noexcept;
/// True once per request_status().
bool take_status_request() noexcept;

struct actor_run_options {
  bool quiet = false;          ///< no progress lines (tests)
  std::string trace_path;      ///< Chrome trace JSON (also cfg's trace key)
  /// Tests: in `step`, stage (replica, stage) gets a stray buffered tensor (the reset
  /// check must report it).
  struct leftover_plant {
    int replica = 0, stage = 0;
    std::int64_t step = 0;
  };
  std::optional<leftover_plant> plant_leftover;
  /// Several nodes: how often the launcher starts a lost node process (not node 0) again
  /// (TROUPE_NODE_RESTARTS); so often the coordinator waits for one to rejoin (up to
  /// train.rejoin_timeout each time).
  int node_restarts = 0;
  /// Gather the whole model at the run's end into actor_run_result::final_state (tests and
  /// callers of run_actor_training read it). `troupe train` and node processes do not:
  /// there only --save and checkpoint_dir gather it, so without them node 0 never holds
  /// more of the model than its own stages.
  bool final_state = true;
  /// What the launcher said besides the configuration (launch/ reads it from the
  /// environment; tests leave it empty).
  launch_info launch;
};

struct actor_run_result {
  int exit_code = 0;
  std::string error;                 ///< why the run failed
  state_dict final_state;            ///< full model after the last step (replica 0)
  std::vector<double> losses;        ///< per committed step
  std::vector<trace_event> events;   ///< every compute event of the run
  std::vector<double> bubbles;       ///< measured per step
  std::vector<double> step_seconds;  ///< wall time of each step (begin to last completion)
  struct evaluation_record : evaluation {
    int step = 0;  ///< after this many steps
  };
  std::vector<evaluation_record> evaluations;  ///< every evaluation of the run
  /// Bytes of initial parameters the process still held at the end (runtime_context::init;
  /// 0 once its stages and shards have taken them).
  std::int64_t initial_bytes_held = 0;
};

/// An actor's exception as its exit reason, with the exception's message (install with
/// set_exception_handler; the supervisor reports the reason to the coordinator).
caf::error error_from_exception(std::exception_ptr& eptr);

/// Runs `cfg` with the actor runtime in this process.
actor_run_result run_actor_training(const job_config& cfg, const actor_run_options& opts = {});

}  // namespace troupe
