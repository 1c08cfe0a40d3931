#pragma once
// Pipeline schedules as data: for each stage, the ordered list of operations it runs.
//
//   gpipe             all forwards, then all backwards (fill, drain)
//   1f1b              Megatron's non-interleaved schedule: min(p - r - 1, m) warm-up
//                     forwards, steady one-forward-one-backward, cool-down backwards
//   interleaved-1f1b  Megatron's interleaved schedule over v virtual chunks per stage
//                     (get_model_chunk_id), m a multiple of p
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace troupe {

struct schedule_error : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

enum class op_kind : std::uint8_t { forward, backward };

/// One operation of a stage: forward or backward of micro-batch `mb` on the stage's
/// virtual chunk `chunk` (0-based on that stage).
struct pipeline_op {
  op_kind kind = op_kind::forward;
  std::int32_t mb = 0;
  std::int32_t chunk = 0;
  bool operator==(const pipeline_op& o) const { return kind == o.kind && mb == o.mb && chunk == o.chunk; }
};

enum class schedule_kind { gpipe, one_f_one_b, interleaved };

std::string to_string(schedule_kind k);
/// "gpipe", "1f1b", "interleaved-1f1b" (also "interleaved"); throws schedule_error.
schedule_kind parse_schedule_kind(const std::string& s);

struct schedule {
  schedule_kind kind = schedule_kind::one_f_one_b;
  int stages = 1;
  int microbatches = 1;
  int chunks = 1;
  std::vector<std::vector<pipeline_op>> ranks;  ///< ranks[r]: stage r's order
};

/// Generates a schedule. Throws schedule_error for illegal arguments (e.g. stages < 1,
/// chunks != 1 for a non-interleaved kind, microbatches not a multiple of stages for
/// interleaving).
schedule make_schedule(schedule_kind kind, int stages, int microbatches, int chunks = 1);

/// Short text of an op: "F3" / "B3", with ".c" for chunk when the schedule has chunks.
std::string to_string(const pipeline_op& op, bool with_chunk);

/// Checks a schedule: every (mb, chunk) forward and backward exactly once per stage,
/// each forward before its backward, and all cross-stage dependencies satisfiable in
/// the given orders (no deadlock). Returns an empty string when valid, else the reason.
std::string validate(const schedule& s);

/// A global order in which all ops can run one at a time, respecting every stage's order
/// and every cross-stage dependency: (stage, index into that stage's list) pairs.
/// Throws schedule_error if the schedule deadlocks.
std::vector<std::pair<int, std::size_t>> execution_order(const schedule& s);

/// Result of simulating a schedule with fixed per-op costs and free communication.
struct simulation {
  double makespan = 0;
  double bubble = 0;                  ///< 1 - busy time / (stages x makespan)
  std::vector<double> busy;           ///< per stage
  std::vector<int> peak_activations;  ///< per stage: max forwards not yet backwarded
  /// Per stage, per op in order: start and end times.
  std::vector<std::vector<std::pair<double, double>>> times;
};

/// Simulates `s` with forward cost `f` and backward cost `b` per op (one chunk).
/// Throws schedule_error if the schedule deadlocks.
simulation simulate(const schedule& s, double f = 1.0, double b = 2.0);

}  // namespace troupe
