#pragma once
// Measured pipeline timing from trace events, and the Chrome trace writer.
#include <cstdint>
#include <string>
#include <vector>

#include "messages/step_messages.hpp"

namespace troupe {

/// One step's measured timing of the stage tracks (replica x stage).
struct step_timing {
  double window_s = 0;              ///< longest replica window: its first compute start to its last end
  double bubble = 0;                ///< 1 - busy / (sum over replicas of stages x window)
  std::vector<double> busy_s;       ///< per track: replica * p + stage
  std::vector<double> idle_s;
  /// Longest, over replicas, from the replica's last compute op's end to the end of its
  /// shards' last reduce-scatter: the gradient reduction the step still waited for once
  /// the backwards were done (0 where it was over before).
  double reduce_tail_s = 0;
};

/// Timing of one step's compute events ("F", "B", "W") over `replicas` x `stages`
/// tracks, and of its reduce-scatters (the shards of rank r are replica r's).
step_timing measure_step(const std::vector<trace_event>& events, int replicas, int stages);

/// One exchange with node 0's clock (nanoseconds of the steady clocks): this node's
/// clock when it asked and when the answer came, and node 0's in between.
struct clock_sample {
  std::int64_t sent_ns = 0, remote_ns = 0, received_ns = 0;
};

/// Node 0's clock minus this node's (Cristian's method): from the sample of the shortest
/// round trip, taking node 0's reading to be from halfway through it; wrong by at most
/// half that round trip (by the difference of the two ways' delays). `round_trip_ns`, if
/// given, gets that round trip. Throws std::invalid_argument for no samples.
std::int64_t clock_offset_ns(const std::vector<clock_sample>& samples, std::int64_t* round_trip_ns = nullptr);

/// Writes `events` as Chrome trace JSON (chrome://tracing, Perfetto): one process per
/// replica with one track per stage (compute, idle gaps, tensor sends as slices and
/// receives as instants), plus one optimizer process.
void write_chrome_trace(const std::string& path, const std::vector<trace_event>& events, int replicas,
                        int stages);

}  // namespace troupe
