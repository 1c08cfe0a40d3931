#pragma once
// The schedule simulator with costs that differ by stage and op, and tensors that take
// time between stages (the planner's: compute/plan/). Defined in simulate.cpp.
#include <functional>

#include "compute/schedule/schedule.hpp"

namespace troupe {

/// Costs that differ by stage and op, and tensors that take time between stages (the
/// planner's: compute/plan/).
struct timed_costs {
  /// One op's time on `stage` (a split B: its own part; a W: the weights' part).
  std::function<double(int stage, const pipeline_op& op)> op;
  /// An F&B pair's time; empty: the two ops' back to back.
  std::function<double(int stage, const pipeline_op& first, const pipeline_op& second)> pair;
  /// The time an activation (from < to) or a gradient (from > to) takes between the
  /// virtual stages; empty: none.
  std::function<double(int from, int to)> transfer;
};
/// Simulates `s` under `c` (as simulate(s, op_costs): an op starts when its stage is free and
/// its inputs have arrived). Throws schedule_error on a deadlock or a negative cost.
simulation simulate(const schedule& s, const timed_costs& c);

}  // namespace troupe
