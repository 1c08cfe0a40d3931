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
//   combined-1f1b     Megatron-Core's combined 1F1B: interleaved-1f1b with one more warm-up
//                     micro-batch, its steady phase's forward and backward run as one
//                     overlapped pair (F&B), whose members are independent, so that one's
//                     all-to-all hides behind the other's compute; v >= 2 when p > 1
//   zbv               ZB-V (Qi et al., "Pipeline Parallelism with Controllable Memory", the
//                     zero-bubble V schedule): two chunks per stage in a V, split backwards,
//                     the peak activation memory of 1f1b
//   dualpipev         DeepSeek's DualPipeV ("cut-in-half" DualPipe): two chunks per stage in
//                     a V, the reference's eight steps per rank with overlapped F&B pairs, some
//                     backwards split into B and W
//
// Placement: virtual stage x is chunk c of stage k. Loop kinds place x = c p + k
// (Megatron's interleaving); V kinds place chunk 0 of stage k at x = k and chunk 1 at
// x = 2p - 1 - k, so stage 0 holds the first and the last virtual stage (the loss).
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
  /// A backward that leaves the weights' gradients to a later W op of the same micro-batch
  /// and chunk (zero-bubble kinds); a backward without it computes them itself.
  bool split = false;
  /// Runs overlapped with the stage's next op, as one F&B pair (combined-1f1b, dualpipev).
  bool paired = false;
  bool operator==(const pipeline_op& o) const {
    return kind == o.kind && mb == o.mb && chunk == o.chunk && split == o.split && paired == o.paired;
  }
};

enum class schedule_kind { gpipe, one_f_one_b, interleaved, zero_bubble, combined_1f1b, zbv, dualpipev };

std::string to_string(schedule_kind k);
/// "gpipe", "1f1b", "interleaved-1f1b" (also "interleaved"), "zero-bubble" (also
/// "zb-h1"), "combined-1f1b", "zbv" (also "zb-v"), "dualpipev"; throws schedule_error.
schedule_kind parse_schedule_kind(const std::string& s);
/// The kinds' names, for messages and help: "gpipe, 1f1b, ..., or dualpipev".
std::string schedule_kind_names();
/// Virtual chunks per stage a kind takes when none are asked for: 2 for the V kinds, else 1.
int default_chunks(schedule_kind k);

struct schedule {
  schedule_kind kind = schedule_kind::one_f_one_b;
  int stages = 1;
  int microbatches = 1;
  int chunks = 1;
  std::vector<std::vector<pipeline_op>> ranks;  ///< ranks[r]: stage r's order
  /// True when some backwards are split into B and W ops (zero-bubble, zbv, dualpipev).
  bool split_backward() const {
    return kind == schedule_kind::zero_bubble || kind == schedule_kind::zbv || kind == schedule_kind::dualpipev;
  }
  /// True for the kinds placing two chunks per stage in a V (zbv, dualpipev).
  bool v_shape() const { return kind == schedule_kind::zbv || kind == schedule_kind::dualpipev; }
  int virtual_stages() const { return stages * chunks; }
  /// The virtual stage chunk `chunk` of stage `stage` runs (see Placement above).
  int virtual_stage(int stage, int chunk) const {
    if (v_shape()) return chunk == 0 ? stage : 2 * stages - 1 - stage;
    return chunk * stages + stage;
  }
  /// The (stage, chunk) running virtual stage `x`.
  std::pair<int, int> place(int x) const {
    if (v_shape()) return x < stages ? std::pair<int, int>{x, 0} : std::pair<int, int>{2 * stages - 1 - x, 1};
    return {x % stages, x / stages};
  }
  /// Stage `stage`'s ops of chunk `chunk` in one step (F, B and W).
  int ops_of_chunk(int stage, int chunk) const;
};

/// Generates a schedule. Throws schedule_error for illegal arguments (e.g. stages < 1,
/// chunks != 1 for a kind without chunks, microbatches not a multiple of stages for
/// interleaving, a V kind with chunks other than 2, dualpipev with fewer than 2p
/// micro-batches). chunks 0: the kind's default_chunks.
schedule make_schedule(schedule_kind kind, int stages, int microbatches, int chunks = 0);

/// "F", "B" or "W" (also the trace's names of the ops).
const char* op_letter(op_kind k);
/// Short text of an op: "F3" / "B3" / "W3", with ".c" for chunk when the schedule has chunks.
std::string to_string(const pipeline_op& op, bool with_chunk);
/// A stage's order as text: ops separated by spaces, an F&B pair's two joined by "&"
/// ("F4.0&B1.1").
std::string order_text(const schedule& s, int stage);

/// Checks a schedule: every (mb, chunk) forward and backward exactly once per stage, a
/// weight pass exactly for each split backward (and none in kinds that do not split),
/// each forward before its backward, each backward before its weight pass, a pair's two
/// ops a forward and a backward and not its own last op, and all cross-stage
/// dependencies satisfiable in the given orders (no deadlock). Returns an empty string
/// when valid, else the reason.
std::string validate(const schedule& s);

/// A global order in which all ops can run one at a time, respecting every stage's order
/// and every cross-stage dependency: (stage, index into that stage's list) pairs.
/// Throws schedule_error if the schedule deadlocks.
std::vector<std::pair<int, std::size_t>> execution_order(const schedule& s);

/// Result of simulating a schedule with fixed per-op costs and free point-to-point
/// communication.
struct simulation {
  double makespan = 0;
  double bubble = 0;                  ///< 1 - busy time / (stages x makespan)
  std::vector<double> busy;           ///< per stage (an F&B pair counts its time once)
  std::vector<double> idle;           ///< per stage: makespan - busy
  /// Per stage: the most (micro-batch, chunk) activations held at once: forwards run whose
  /// backward has not finished (for split backwards: whose W has not run; B frees only
  /// part of them). In chunks' activations: 1f1b's p equals a V kind's 2p.
  std::vector<int> peak_activations;
  /// Per stage, per op in order: start and end times (a pair's two ops share theirs).
  std::vector<std::vector<std::pair<double, double>>> times;
};

/// Per-op costs of the simulator (one chunk's op).
struct op_costs {
  double forward = 1.0;
  /// The whole backward's. A split backward's B costs backward - weight, its W weight.
  double backward = 2.0;
  /// < 0: half the backward's (kinds that split; 0 for the others).
  double weight = -1.0;
  /// An F&B pair's time (DualPipe's F&B). < 0: the two ops' compute back to back, or
  /// their all-to-alls back to back where those take longer.
  double pair = -1.0;
  /// The all-to-all time of one op (an expert layer's dispatch and combine, summed over
  /// the chunk's layers). An op outside a pair waits for its own; in a pair each op's
  /// all-to-all hides behind the other op's compute (ideal overlap).
  double alltoall = 0.0;
};

/// One op's compute time under `c` in schedule `s` (its all-to-all not included): a
/// forward's, a W's (the weight part: c.weight, or half the backward's in kinds that
/// split, 0 in the others), a split B's (the backward's less the weight part), a whole B's.
double compute_cost(const schedule& s, const op_costs& c, const pipeline_op& op);

/// Simulates `s`: an op starts when its stage is free and its inputs exist. Throws
/// schedule_error if the schedule deadlocks, for a negative cost, and for a weight cost
/// above the backward's.
simulation simulate(const schedule& s, const op_costs& costs);
/// simulate with forward cost f, backward cost b and weight cost w.
simulation simulate(const schedule& s, double f = 1.0, double b = 2.0, double w = -1.0);

}  // namespace troupe
