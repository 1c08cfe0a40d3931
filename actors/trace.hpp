#pragma once
// Measured pipeline timing from trace events, and the Chrome trace writer.
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "messages/step_messages.hpp"

namespace troupe {

/// One step's measured timing of the stage tracks (replica x stage).
struct step_timing {
  double window_s = 0;              ///< longest replica window: its first compute start to its last end
  double bubble = 0;                ///< 1 - busy / (sum over replicas of stages x window)
  std::vector<double> busy_s;       ///< per track (replica * p + stage): the union of its ops' spans
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

/// This process's steady clock (nanoseconds).
std::int64_t steady_clock_ns();

/// The job's timeline, as this process reads it: microseconds since the coordinator's
/// start on node 0's steady clock. Node 0's machine shares that clock. A node on another
/// machine maps its own clock onto node 0's with the clock probes it has made so far
/// (add_probe): node 0's clock = local + offset(local), offset(t) = a + b (t - t0) the
/// weighted least-squares line through the probes' offsets (weights 1 / (round trip / 2)^2,
/// the last 32 probes), so a drift of one machine's clock against the other's is followed,
/// not only the offset at the start. Thread-safe: every actor stamps its trace events here.
class job_clock {
 public:
  /// `epoch_ns`: the timeline's origin on node 0's clock. Tests only: this process's clock
  /// reads as if `skew_ns` ahead and running fast by `drift_ppm` parts per million.
  explicit job_clock(std::int64_t epoch_ns, std::int64_t skew_ns = 0, double drift_ppm = 0);
  /// This process's clock (with a test's pretended skew and drift).
  std::int64_t local_ns() const;
  /// One probe round (a few round trips to node 0, in local_ns's clock): refits the line.
  /// Returns the round's offset (clock_offset_ns); `round_trip_ns` gets its best round trip.
  std::int64_t add_probe(const std::vector<clock_sample>& samples, std::int64_t* round_trip_ns = nullptr);
  /// Node 0's clock minus this process's at local time `local`, by the current line.
  std::int64_t offset_ns(std::int64_t local) const;
  /// How fast this process's clock runs against node 0's by the current line, in parts
  /// per million (positive: it gains): 0 until two probes.
  double drift_ppm() const;
  /// Probe rounds so far and the local time between the first and the last (seconds).
  int probes() const;
  double probed_span_s() const;
  /// Now on the job's timeline (microseconds since its origin).
  double now_us() const;

 private:
  struct point {
    std::int64_t local_ns, offset_ns;
    double weight;
  };
  void refit();  // under m_
  const std::int64_t epoch_ns_, skew_ns_, origin_ns_;
  const double drift_;
  mutable std::mutex m_;
  std::vector<point> points_;  // the last 32 probes
  int probes_ = 0;
  std::int64_t first_probe_ns_ = 0;
  std::int64_t t0_ = 0;   // the line's reference local time
  double a_ = 0, b_ = 0;  // offset at t0, and its slope
};

/// Writes `events` as Chrome trace JSON (chrome://tracing, Perfetto): one process per
/// replica with one track per stage (compute, idle gaps, tensor sends as slices and
/// receives as instants), plus one optimizer process.
void write_chrome_trace(const std::string& path, const std::vector<trace_event>& events, int replicas,
                        int stages);

}  // namespace troupe
