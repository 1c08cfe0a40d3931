#pragma once
// Pipeline timelines drawn as SVG, one row per stage, as the Zero Bubble and DualPipe
// papers draw them: F, B and W blocks coloured by kind (a chunk's shade per virtual
// chunk) and numbered with their micro-batch, F&B pairs under one border, all-to-alls
// as thin blocks under their op. The same drawing comes from a schedule's simulation
// (`troupe schedule --format svg`) and from a run's Chrome trace (`troupe trace-svg`),
// so that the plan and what ran can be put side by side.
#include <string>
#include <vector>

#include "compute/schedule/schedule.hpp"

namespace troupe {

struct timeline_block {
  int row = 0;          ///< stage
  op_kind kind = op_kind::forward;
  int mb = 0;
  int chunk = 0;
  double start = 0, end = 0;
  bool paired = false;  ///< one of an F&B pair (drawn inside the pair's border)
  double alltoall = 0;  ///< its all-to-all's time, drawn under it (0: none)
};

struct timeline {
  std::string title;
  int rows = 0;
  bool chunks = false;  ///< label blocks "mb.chunk"
  std::string unit;     ///< of the time axis ("op costs", "ms")
  std::vector<timeline_block> blocks;
};

/// The simulated timeline of `s` (simulate(s, costs)); an F&B pair's two ops split its
/// interval in the ratio of their compute costs.
timeline timeline_of(const schedule& s, const op_costs& costs);

/// One step of one replica of a Chrome trace written by the actor runtime (its "compute"
/// events), in milliseconds from the step's first op. step < 0: the trace's last step.
/// Throws std::runtime_error for unreadable JSON, and when the step or replica has no
/// compute events.
timeline timeline_of_trace(const std::string& trace_json, long long step = -1, int replica = 0);

/// The drawing. Each op is one <rect class="op" data-row=... data-op="F3.1">.
std::string to_svg(const timeline& t);

}  // namespace troupe
