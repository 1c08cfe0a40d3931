#pragma once
// The coordinator's state and the parts of its protocol in files of their own, beside
// coordinator.cpp (the step: begin, reports, commit, retries, the hang watchdog):
// phases.cpp (its named behaviors, one per phase), checkpoints.cpp (the model and moments
// gathered from the actors, --save files and checkpoint folders), metrics.cpp (the
// metrics log) and evaluation.cpp (evaluation in this process or through the pipeline).
// Internal to actors/coordinator/.
#include <chrono>
#include <ctime>
#include <cstdint>
#include <deque>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <caf/all.hpp>
#include <nlohmann/json.hpp>

#include "actors/coordinator/coordinator.hpp"
#include "compute/runtime/kernel_profile.hpp"
#include "compute/optim/optimizer.hpp"
#include "compute/trainer/local_trainer.hpp"

namespace troupe::coordinator {

constexpr auto state_timeout = std::chrono::seconds(60);
constexpr auto checkpoint_write_timeout = std::chrono::minutes(10);  // a stage's files, on a slow shared disk
constexpr auto reset_check_timeout = std::chrono::seconds(60);
constexpr auto watchdog_tick = std::chrono::milliseconds(500);
constexpr auto wait_answer_timeout = std::chrono::seconds(2);  // an actor's answer to the hang probe
constexpr double first_step_hang_seconds = 60;               // the watchdog's limit before a step's time is known
constexpr std::size_t recent_step_count = 16;                // the steps whose median sets the limit

/// A checkpoint folder whose stages' files are being written in the background
/// (output.checkpoint_async): the snapshots are taken, the writers not all done.
struct pending_checkpoint {
  std::int64_t step = 0;            ///< its folder's step (the steps it has finished)
  std::vector<std::function<void()>> waiting;  ///< what waits for it to end (the next checkpoint, the run's end)
  /// A monitored writer ended (its node lost): true where it is one of this folder's.
  std::function<bool(const caf::down_msg&)> on_down;
};

/// The coordinator's phases, each a named behavior (actors/coordinator/phases.cpp; the diagram
/// in actors/coordinator/coordinator.hpp). What a phase does not expect is dropped there explicitly.
enum class phase {
  idle,           ///< spawned: waits for run_atom
  wiring,         ///< the supervisors' actors are collected and wired, before a step's begin
  stepping,       ///< a step runs: its reports are counted until the commit
  between_steps,  ///< committed: reset check, checkpoints, then the next begin
  evaluating,     ///< committed: an evaluation's forwards run through the pipeline
  rebuilding,     ///< the supervisors rebuild their actors for an in-place retry
  finished,       ///< the run request is answered; the actor quits
};

const char* phase_name(phase p);

struct coordinator_state {
  std::shared_ptr<const runtime_context> ctx;
  std::shared_ptr<job_wiring> wiring;
  actor_run_options opts;
  std::shared_ptr<actor_run_result> result;
  std::vector<supervisor_actor> supervisors;  // one per node
  caf::typed_response_promise<int> done;  // the run request: the exit code
  /// The behavior installed now, by name: set only by enter(), together with it. Which
  /// messages a phase takes is its behavior's alone; `at` is read where no behavior
  /// decides: by the helpers several phases call (finish, fail), by what outlives a
  /// behavior (answers to requests, timers, the hang watchdog's tick) and by the logs.
  phase at = phase::idle;
  lr_schedule lrs;
  std::optional<batch> eval_set;  // read at the first evaluation
  std::ofstream metrics;
  // per step
  std::int64_t step = 0;
  step_stats stats;
  double started_us = 0;
  std::vector<double> losses, partials;
  int n_losses = 0, n_partials = 0, n_stages = 0, n_shards = 0;
  // Which reports of this step arrived (a duplicate is dropped, never counted twice).
  std::vector<bool> seen_losses, seen_partials, seen_stages, seen_shards;
  std::vector<trace_event> events;
  std::vector<int> peaks;
  double elapsed = 0;
  int timed = 0;
  int skipped = 0;           // updates skipped for NaN/inf gradients
  bool skipping = false;     // this step's update is skipped
  double checkpoint_seconds = 0;  // training waited for the checkpoint folders written (a write, or a snapshot)
  double durable_seconds = 0;     // background folders: from the snapshot until durable
  int checkpoints = 0;
  int background_checkpoints = 0;  // of `checkpoints`: written while training went on
  std::shared_ptr<pending_checkpoint> pending;  // a folder being written in the background (null: none)
  bool ending = false;  // the run ends once the pending folder is written (finish_after_write)
  std::int64_t writing_at_begin = -1;  // the step of the folder being written as this step began (-1: none)
  int checkpoint_failures = 0;  // checkpoints due that could not be written (the run went on)
  std::int64_t saved_step = -1;  // the step of this run's newest --save pair (-1: none yet)
  std::string last_folder;       // this run's newest checkpoint folder ("": none yet)
  std::string save_failure;      // the run's last --save could not be written: why, and what is intact
  nlohmann::json recovery;   // a resumed run's "resume" line, written with its first step
  std::int32_t attempt = 0;  // of this step: > 0 after in-place retries
  std::int32_t rounds = 0;   // in-place recoveries so far (the actors' generation)
  bool node_lost = false;    // a node process that cannot rejoin is gone: no in-place retry
  registrar_actor registrar;  // several nodes: where a lost node's restarted process rejoins
  std::map<int, supervisor_actor> lost;  // lost nodes awaiting a restarted process: their old supervisor
  int rejoins = 0;           // node processes the launcher restarted so far (opts.node_restarts)
  int skipped_before = 0;    // `skipped` when the step began (a retry counts again)
  // An evaluation through the pipeline (between steps): each forward's score, by forward.
  std::vector<eval_score> eval_scores;
  std::vector<bool> seen_evals;
  int n_evals = 0;
  std::function<void(evaluation)> eval_then;
  // The hang watchdog: the seconds of the last committed steps, when this step last made
  // progress (a report arrived), and whether the actors are being asked what they wait for.
  std::deque<double> recent_steps;
  double last_progress_us = 0;
  bool diagnosing = false;
  // What it sent this step (the wait-for graph): begin_step to every actor, the clip factor
  // to every shard. Flags, not keys: the keys are made only when the graph is asked for.
  bool sent_begin = false, sent_clip = false;
  /// The step's work of the coordinator itself: CPU time in its step's handlers (its
  /// thread's clock) and the messages they took and sent (the metrics line's
  /// coordinator_cpu_seconds and coordinator_messages).
  double step_cpu_s = 0;
  double step_process_cpu0 = 0;  ///< this process's CPU seconds at the step's begin
  std::int64_t step_messages_in = 0, step_messages_out = 0;
  std::vector<int> stage_nodes;      // [replica * p + stage]: the node of the stage (and of its shard)
  std::vector<int> loader_nodes;     // [replica]
  // TROUPE_KERNEL_PROFILE: the GPU kernels of chosen steps (compute/runtime/kernel_profile.hpp).
  std::optional<kernel_profile_request> profile_request;
  std::shared_ptr<kernel_profile> profile;
};

using self_ptr = coordinator_actor::stateful_pointer<coordinator_state>;

/// The coordinator's CPU time from its construction to its end (its thread's clock), added
/// to the step's (coordinator_state::step_cpu_s).
class cpu_meter {
 public:
  explicit cpu_meter(coordinator_state& s) : s_(s), start_(thread_seconds()) {}
  ~cpu_meter() { s_.step_cpu_s += thread_seconds() - start_; }
  cpu_meter(const cpu_meter&) = delete;
  cpu_meter& operator=(const cpu_meter&) = delete;
  static double thread_seconds() { return seconds_of(CLOCK_THREAD_CPUTIME_ID); }
  static double process_seconds() { return seconds_of(CLOCK_PROCESS_CPUTIME_ID); }
  static double seconds_of(clockid_t clock) {
    timespec t{};
    clock_gettime(clock, &t);
    return double(t.tv_sec) + double(t.tv_nsec) * 1e-9;
  }

 private:
  coordinator_state& s_;
  double start_;
};

/// A step's report handled: one message in, its CPU time counted.
template <class F>
void counted(self_ptr self, F&& handle) {
  const cpu_meter meter(self->state);
  ++self->state.step_messages_in;
  handle();
}

// --- actors/coordinator/coordinator.cpp

/// Aborts the step and ends the run, or retries it in place (see the definition).
/// `new_round`: also while rebuilding (a node lost during it: that round cannot finish).
void fail(self_ptr self, const std::string& why, bool recoverable = true, bool new_round = false);
/// Stops everything and answers the run request with `code`.
void finish(self_ptr self, int code, const std::string& error);
/// finish, once a folder being written in the background is complete (or abandoned):
/// the step it holds was committed, so a restart resumes from it.
void finish_after_write(self_ptr self, int code, const std::string& error);
/// True the first time report `index` of this step arrives; a duplicate is logged and dropped.
bool first_report(std::vector<bool>& seen, std::size_t index, const char* what, std::int64_t step);
// The handlers of the phases' messages.
caf::typed_response_promise<int> on_run(self_ptr self);
void on_step_reports(self_ptr self, step_reports& msg);
void on_loss_report(self_ptr self, const loss_report& msg);
void on_grad_norm_partial(self_ptr self, const grad_norm_partial& msg);
void on_stage_done(self_ptr self, stage_done& msg);
void on_shard_done(self_ptr self, shard_done& msg);
void on_failure(self_ptr self, const runtime_failure& msg);
void on_watchdog(self_ptr self);
void on_step_timeout(self_ptr self, std::int64_t step, std::int32_t attempt);

// --- actors/coordinator/phases.cpp

/// Switches to phase `next`: its behavior (none for finished: the actor quits).
void enter(self_ptr self, phase next);
/// The behavior the coordinator is spawned with.
coordinator_actor::behavior_type idle(self_ptr self);
/// request_all's `failed` that ends the wait and fails the step: "WHAT: the error".
std::function<bool(std::size_t, caf::error&)> fail_with(self_ptr self, std::string what);
/// Every actor of the rows of `grid`, row by row.
template <class Handle>
std::vector<Handle> all_of(const std::vector<std::vector<Handle>>& grid) {
  std::vector<Handle> out;
  for (const auto& row : grid) out.insert(out.end(), row.begin(), row.end());
  return out;
}

// --- actors/coordinator/checkpoints.cpp

/// Fetches the full model (model order, on the host) from replica 0's stages (tensor
/// parallelism: those of each of its ranks, the parts put together), then calls `then`.
void fetch_state(self_ptr self, std::function<void(state_dict)> then);
/// Fetches every optimizer shard's AdamW moments (and, in bf16 jobs, main parameters) by
/// parameter name (tensor parallelism: each rank's parts put together into the whole
/// parameters of `model`'s shapes), then calls `then`.
void fetch_moments(self_ptr self, const state_dict& model, std::function<void(named_moments)> then);
/// The model to save and report: replica 0's stages' parameters, or where they are
/// rounded (bf16 jobs) the shards' fp32 main parameters. Fetches the shards' state, puts
/// their main parameters into `model`, then calls `then` with both.
void with_shard_state(self_ptr self, state_dict model, std::function<void(state_dict, named_moments)> then);
/// The model to report at the end (final_state), then `then`.
void fetch_final_state(self_ptr self, std::function<void(state_dict)> then);
/// A checkpoint due after this step that could not be written. An interim one (a full
/// disk) does not end the run: the training state is whole in memory, so it is logged and
/// the run goes on to the next one; but the run's last (`final`: the end, or a stop) must
/// be written: false (the run failed).
bool checkpoint_failed(self_ptr self, std::int64_t step, const std::string& what, bool final);
/// Writes the --save pair FILE and FILE.optim (as the plain loop does) from the gathered
/// model. False where the run failed (see checkpoint_failed). The run's last that cannot
/// be written sets save_failure: the checkpoint folder is still written, then the run
/// fails with save_failure_text.
bool save_file(self_ptr self, const state_dict& model, const named_moments& moments, bool final);
/// Why the run's last --save failed, what is intact, and where the final weights are.
std::string save_failure_text(const coordinator_state& s);
/// Writes a checkpoint folder in checkpoint_dir. No process gathers the model for it:
/// this one creates the step's temporary folder, replica 0's stages write their files
/// into it from their own processes (write_checkpoint), and this one then writes the
/// manifest and renames the folder. Calls `then` unless the run failed (see
/// checkpoint_failed). With checkpoint_async (not the run's last, `final`): `then` as
/// soon as the stages hold their snapshots; the folder is completed once every writer
/// has answered (`pending` meanwhile). At most one is pending: a folder due while one
/// is waits for it.
void write_folder(self_ptr self, bool final, std::function<void()> then);
/// The run ends with a folder still being written: it is abandoned (the previous
/// checkpoint stays the newest).
void abandon_pending_checkpoint(self_ptr self);

// --- actors/coordinator/metrics.cpp

/// Appends a step's line to the metrics log (after a resumed run's "resume" line).
void write_metrics(self_ptr self, const nlohmann::json& line);
/// A fresh run starts a new metrics log (an older run's lines would mix with its own). A
/// resumed or restarted run, or one asked to resume, continues it: lines of the steps it
/// runs again go (they come back as the steps commit), events stay, and a "resume" line
/// says from where and how much runs again.
void open_metrics(self_ptr self);

// --- actors/coordinator/evaluation.cpp

/// Writes an evaluation's fields and time (`eval_seconds`) into the step's metrics line and
/// keeps it for the run's result.
void record_evaluation(self_ptr self, const evaluation& e, double seconds, nlohmann::json& line);
/// The evaluation set, read at the first evaluation and kept.
const batch& evaluation_set(self_ptr self);
/// eval_mode gather: evaluates the whole model, gathered from the stages, here.
void evaluate(self_ptr self, const state_dict& state, nlohmann::json& line, double t0);
/// eval_mode pipeline (Megatron's forward-only schedule): the evaluation set's forwards
/// go forward only through the stage actors, forward f through replica f mod d (expert
/// parallelism: through each replica of group f mod (d / EP)), all of them sent at once
/// (a stage runs each as its input arrives, so the forwards pipeline); the last stages
/// score them (`eval_result`). Once every forward is scored the stages
/// hand over their ops' trace events, and `then` gets the evaluation, combined in forward
/// order as evaluate_model combines it. Nothing is gathered: no process holds more of the
/// model than its stages. A failure or a timeout (step_timeout) ends the run as a failure
/// after a committed step does (exit 75: a restart from the newest checkpoint).
void evaluate_in_pipeline(self_ptr self, std::function<void(evaluation)> then);
/// Every forward is scored: collects the stages' evaluation events (the trace), then
/// hands the evaluation on.
void end_evaluation(self_ptr self);
/// An evaluation forward's score; after the last, end_evaluation.
void on_eval_result(self_ptr self, const eval_result& msg);
/// The evaluation's time limit (step_timeout) is up.
void on_eval_timeout(self_ptr self, std::int64_t step);

}  // namespace troupe::coordinator
