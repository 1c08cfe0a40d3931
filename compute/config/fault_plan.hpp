#pragma once
// Fault injection for tests: the [faults] keys of a job, parsed once into typed faults.
// The actors ask the plan (through their runtime context) whether a fault of theirs fires;
// nothing else parses the keys' text.
//
//   throw_at  = "replica:stage:step[:late|:eval]"   a stage actor throws
//   message   = "ACTION[=SECONDS]@replica:stage:step[:loss|:eval]"
//               ACTION: drop | duplicate | corrupt | delay (SECONDS: the delay, default 0.3)
//   stall     = "stage:rank:step"                    a shard never starts its reduce-scatter
//   freeze    = "replica:stage:step[:SECONDS]"       a stage actor's thread blocks (default 15 s)
//   kill_node = "node:step[+node:step...]"           a node process SIGKILLs itself
//   freeze_node = "node:step[+node:step...]"         a simulated node goes silent (frozen, cut off)
//   kill_in_write = "node:step[:SECONDS]"            ... during its background checkpoint write
//   nan_at    = step                                 the last stages' losses are NaN
//   attempt   = N                                    the launch the faults fire in
// Steps are 0-based indices. Every fault fires in the first attempt of its step only
// (an in-place retry of that step runs clean).
#include <cstdint>
#include <map>
#include <optional>
#include <string>

namespace troupe {

/// The [faults] keys of a job as they were given (job_config::faults()), and the job's
/// pipeline depth (the stages they name are checked against it).
struct fault_keys {
  std::string throw_at;
  int nan_at = -1;
  std::string kill_node;
  std::string message;
  std::string stall;
  std::string freeze;
  int fault_attempt = 0;
  int pipeline = 1;
  std::string kill_in_write;
  std::string freeze_node;
};

/// When a stage actor throws: before the step's second op, as its updated parameters
/// arrive (after the update), or in the evaluation after the step.
enum class throw_point { in_step, after_update, in_evaluation };

struct stage_throw_fault {
  int replica = 0, stage = 0;
  std::int64_t step = 0;
  throw_point when = throw_point::in_step;
};

enum class message_action { drop, duplicate, corrupt, delay };

/// Which of a stage's messages a message fault hits: its first tensor message of the
/// step (an activation or gradient), the last stage's first loss report, or its first
/// evaluation result after the step.
enum class message_target { tensor, loss_report, eval_result };

struct message_fault {
  message_action action = message_action::drop;
  int replica = 0, stage = 0;
  std::int64_t step = 0;
  message_target target = message_target::tensor;
  double delay_seconds = 0.3;
};

struct stall_fault {
  int stage = 0, rank = 0;
  std::int64_t step = 0;
};

struct freeze_fault {
  int replica = 0, stage = 0;
  std::int64_t step = 0;
  double seconds = 15;
};

/// A node process that SIGKILLs itself `seconds` after its background write of the
/// checkpoint after step `step` (0-based index) begins.
struct write_kill_fault {
  int node = 0;
  std::int64_t step = 0;
  double seconds = 0;
};

struct fault_plan {
  std::optional<stage_throw_fault> stage_throw;
  std::optional<message_fault> message;
  std::optional<stall_fault> stall;
  std::optional<freeze_fault> freeze;
  std::map<int, std::int64_t> kills;  ///< node -> the step whose beginning kills its process
  std::map<int, std::int64_t> freezes;  ///< simulated node -> the step whose beginning silences it
  std::optional<write_kill_fault> write_kill;
  std::int64_t nan_at = -1;
  int attempt = 0;                    ///< the launch the faults fire in

  /// Parses the [faults] keys; throws config_error naming the key and its value.
  static fault_plan parse(const fault_keys& cfg);
  bool empty() const;
};

const char* name(message_action a);

/// What an actor asks before it acts: does one of the plan's faults fire now? Each actor
/// holds its own copy (message faults and freezes fire once per actor). A fault fires
/// only in the first attempt of its step (attempt 0): the in-place retry runs clean.
class fault_injector {
 public:
  fault_injector() = default;
  explicit fault_injector(fault_plan plan) : plan_(std::move(plan)) {}

  bool stage_throws(int replica, int stage, std::int64_t step, std::int32_t attempt, throw_point at) const;
  /// The message fault on stage (replica, stage)'s first `target` message of `step`, once.
  std::optional<message_fault> take_message(int replica, int stage, std::int64_t step, std::int32_t attempt,
                                            message_target target);
  /// Seconds stage (replica, stage) blocks its thread in `step`, once.
  std::optional<double> take_freeze(int replica, int stage, std::int64_t step, std::int32_t attempt);
  bool shard_stalls(int stage, int rank, std::int64_t step, std::int32_t attempt) const;
  bool kills_node(int node, std::int64_t step, std::int32_t attempt) const;
  /// Whether simulated node `node` goes silent as `step` begins (faults.freeze_node).
  bool freezes_node(int node, std::int64_t step, std::int32_t attempt) const;
  /// Seconds after which node `node` dies in its background write of the checkpoint
  /// after step `step` (checkpoints are written in a step's first attempt's launch only).
  std::optional<double> write_kill(int node, std::int64_t step) const;
  bool nan_loss(std::int64_t step, std::int32_t attempt) const;

 private:
  fault_plan plan_;
  bool message_fired_ = false, freeze_fired_ = false;
};

}  // namespace troupe
