#pragma once
// Pipeline schedules as data: for each stage, the ordered list of operations it runs.
//
//   gpipe             all forwards, then all backwards (fill, drain)
//   1f1b              Megatron's non-interleaved schedule: min(p - r - 1, m) warm-up
//                     forwards, steady one-forward-one-backward, cool-down backwards
//   interleaved-1f1b  Megatron's interleaved schedule over v virtual chunks per stage
//                     (get_model_chunk_id), m a multiple of p
//   zero-bubble       ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2023): the
//                     backward split into B (the input's gradient, on the critical path)
//                     and W (the weights' gradients, which nothing waits for); 1f1b's
//                     order of F and B, with stage r running each W up to r ops late so
//                     that the W's fill the cool-down's bubbles
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace troupe {

struct schedule_error : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

/// forward, backward (for kinds without W: the whole backward; with W: the input's
/// gradient only) and weight (the weights' gradients a split backward left).
enum class op_kind : std::uint8_t { forward, backward, weight };

/// One operation of a stage: forward, backward or weight-gradient pass of micro-batch `mb` on the stage's
/// virtual chunk `chunk` (0-based on that stage).
struct pipeline_op {
  op_kind kind = op_kind::forward;
  std::int32_t mb = 0;
  std::int32_t chunk = 0;
  bool operator==(const pipeline_op& o) const { return kind == o.kind && mb == o.mb && chunk == o.chunk; }
};

enum class schedule_kind { gpipe, one_f_one_b, interleaved, zero_bubble };

std::string to_string(schedule_kind k);
/// "gpipe", "1f1b", "interleaved-1f1b" (also "interleaved"), "zero-bubble" (also
/// "zb-h1"); throws schedule_error.
schedule_kind parse_schedule_kind(const std::string& s);

struct schedule {
  schedule_kind kind = schedule_kind::one_f_one_b;
  int stages = 1;
  int microbatches = 1;
  int chunks = 1;
  std::vector<std::vector<pipeline_op>> ranks;  ///< ranks[r]: stage r's order
  /// True when the backward is split into B and W ops (zero-bubble).
  bool split_backward() const { return kind == schedule_kind::zero_bubble; }
};

/// Generates a schedule. Throws schedule_error for illegal arguments (e.g. stages < 1,
/// chunks != 1 for a non-interleaved kind, microbatches not a multiple of stages for
/// interleaving).
schedule make_schedule(schedule_kind kind, int stages, int microbatches, int chunks = 1);

/// "F", "B" or "W" (also the trace's names of the ops).
const char* op_letter(op_kind k);
/// Short text of an op: "F3" / "B3" / "W3", with ".c" for chunk when the schedule has chunks.
std::string to_string(const pipeline_op& op, bool with_chunk);

/// Checks a schedule: every (mb, chunk) forward and backward exactly once per stage (and
/// weight pass, when the schedule splits the backward; none otherwise), each forward
/// before its backward, each backward before its weight pass, and all cross-stage
/// dependencies satisfiable in the given orders (no deadlock). Returns an empty string
/// when valid, else the reason.
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
  /// Per stage: the most micro-batches whose forward ran and whose backward has not
  /// finished (for split backwards: whose W has not run; B frees only part of them).
  std::vector<int> peak_activations;
  /// Per stage, per op in order: start and end times.
  std::vector<std::vector<std::pair<double, double>>> times;
};

/// Simulates `s` with forward cost `f` and backward cost `b` per op (one chunk). For a
/// split backward, `b` is still the whole backward's: B costs b - w and W costs w
/// (w < 0: half of b; ignored for other kinds). Throws schedule_error if the schedule
/// deadlocks, and for a split backward's w above b.
simulation simulate(const schedule& s, double f = 1.0, double b = 2.0, double w = -1.0);

}  // namespace troupe
