#include "actors/trace.hpp"

#include <algorithm>
#include <chrono>
#include <fstream>
#include <limits>
#include <map>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "compute/checkpoint/checkpoint.hpp"

namespace troupe {

namespace {
bool is_compute(const trace_event& e) { return e.name == "F" || e.name == "B" || e.name == "W"; }
/// A stage's tensor message: "send <what>" or "recv <what>".
bool is_comm(const trace_event& e) { return e.name.rfind("send ", 0) == 0 || e.name.rfind("recv ", 0) == 0; }
/// A forward of an evaluation between steps (its `mb`: the evaluation's forward).
bool is_eval(const trace_event& e) { return e.name == "eval F"; }
/// An expert layer's all-to-all (expert parallelism), inside the op it served.
bool is_all_to_all(const trace_event& e) { return e.name == "all-to-all"; }
/// A tensor-parallel group's collective ("tp all-reduce", ...), inside the op it served.
bool is_tensor_parallel(const trace_event& e) { return e.name.rfind("tp ", 0) == 0; }
/// A checkpoint-writing stage's fetch of its shards' optimizer state, its snapshot in host
/// memory (a background write), or its file writes.
bool is_checkpoint(const trace_event& e) {
  return e.name == "checkpoint gather" || e.name == "checkpoint snapshot" || e.name == "checkpoint write";
}
}  // namespace

step_timing measure_step(const std::vector<trace_event>& events, int replicas, int stages) {
  // Per replica: its stages' busy time within its own window (first op to last op). In a
  // multi-node job each node's events are on that node's clock, set at join to node 0's
  // timeline (clock_offset_ns; exact between nodes of one machine).
  step_timing t;
  t.busy_s.assign(std::size_t(replicas) * stages, 0.0);
  t.idle_s.assign(t.busy_s.size(), 0.0);
  std::vector<double> first(replicas, std::numeric_limits<double>::max()), last(replicas, 0), reduced(replicas, 0);
  std::vector<std::vector<std::pair<double, double>>> spans(t.busy_s.size());  // per track: its ops' (start, end)
  for (const auto& e : events) {
    if (e.name == "reduce-scatter") reduced.at(e.replica) = std::max(reduced[e.replica], e.end_us);
    if (!is_compute(e)) continue;
    first.at(e.replica) = std::min(first[e.replica], e.start_us);
    last.at(e.replica) = std::max(last[e.replica], e.end_us);
    spans.at(std::size_t(e.replica) * stages + e.stage).emplace_back(e.start_us, e.end_us);
  }
  // Busy: the union of a track's ops (an overlapped pair's two count once where they overlap).
  for (std::size_t i = 0; i < spans.size(); ++i) {
    auto& v = spans[i];
    std::sort(v.begin(), v.end());
    double until = -std::numeric_limits<double>::max();
    for (const auto& [a, b] : v) {
      if (b > until) t.busy_s[i] += (b - std::max(a, until)) * 1e-6;
      until = std::max(until, b);
    }
  }
  double busy = 0, capacity = 0;
  for (int r = 0; r < replicas; ++r) {
    if (last[r] <= first[r]) continue;
    const double window = (last[r] - first[r]) * 1e-6;
    t.window_s = std::max(t.window_s, window);
    t.reduce_tail_s = std::max(t.reduce_tail_s, (reduced[r] - last[r]) * 1e-6);
    for (int k = 0; k < stages; ++k) {
      const auto i = std::size_t(r) * stages + k;
      t.idle_s[i] = window - t.busy_s[i];
      busy += t.busy_s[i];
      capacity += window;
    }
  }
  if (capacity > 0) t.bubble = 1.0 - busy / capacity;
  return t;
}

namespace {
std::int64_t round_trip_of(const clock_sample& c) { return c.received_ns - c.sent_ns; }
/// The sample of the shortest round trip: the one whose offset is the surest.
const clock_sample& quickest(const std::vector<clock_sample>& samples) {
  if (samples.empty()) throw std::invalid_argument("clock_offset_ns: no samples");
  return *std::min_element(samples.begin(), samples.end(),
                           [](const auto& a, const auto& b) { return round_trip_of(a) < round_trip_of(b); });
}
/// The local time node 0 is taken to have read its clock: halfway through the round trip.
std::int64_t midpoint_ns(const clock_sample& c) { return c.sent_ns + round_trip_of(c) / 2; }
std::int64_t offset_of(const clock_sample& c) { return c.remote_ns - midpoint_ns(c); }
}  // namespace

std::int64_t clock_offset_ns(const std::vector<clock_sample>& samples, std::int64_t* round_trip_ns) {
  const auto& best = quickest(samples);
  if (round_trip_ns) *round_trip_ns = round_trip_of(best);
  return offset_of(best);
}

std::int64_t steady_clock_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

job_clock::job_clock(std::int64_t epoch_ns, std::int64_t skew_ns, double drift_ppm)
    : epoch_ns_(epoch_ns), skew_ns_(skew_ns), origin_ns_(steady_clock_ns()), drift_(drift_ppm * 1e-6) {}

std::int64_t job_clock::local_ns() const {
  const auto now = steady_clock_ns();
  if (drift_ == 0) return now + skew_ns_;
  return now + skew_ns_ + std::int64_t(double(now - origin_ns_) * drift_);
}

std::int64_t job_clock::add_probe(const std::vector<clock_sample>& samples, std::int64_t* round_trip_ns) {
  const auto& best = quickest(samples);
  const auto round_trip = round_trip_of(best), offset = offset_of(best);
  if (round_trip_ns) *round_trip_ns = round_trip;
  // The offset is wrong by at most half the round trip: weigh by that bound (1 us at least).
  const double bound = std::max(1000.0, double(round_trip) / 2);
  std::lock_guard<std::mutex> lock(m_);
  points_.push_back({midpoint_ns(best), offset, 1.0 / (bound * bound)});
  if (probes_++ == 0) first_probe_ns_ = points_.back().local_ns;
  if (points_.size() > 32) points_.erase(points_.begin());
  refit();
  return offset;
}

void job_clock::refit() {
  // Weighted least squares of offset over local time, relative to the first point (the
  // nanosecond counts themselves would lose precision as doubles).
  const auto base_t = points_.front().local_ns;
  const auto base_o = points_.front().offset_ns;
  double sw = 0, st = 0, so = 0;
  for (const auto& p : points_) {
    sw += p.weight;
    st += p.weight * double(p.local_ns - base_t);
    so += p.weight * double(p.offset_ns - base_o);
  }
  const double mt = st / sw, mo = so / sw;
  double stt = 0, sto = 0;
  for (const auto& p : points_) {
    const double dt = double(p.local_ns - base_t) - mt;
    stt += p.weight * dt * dt;
    sto += p.weight * dt * (double(p.offset_ns - base_o) - mo);
  }
  t0_ = base_t + std::int64_t(mt);
  a_ = double(base_o) + mo;
  // One probe (or all at one instant): the offset alone. A slope beyond 5 % is no clock's
  // drift but noise over a short span: bounded there.
  b_ = stt > 0 ? std::clamp(sto / stt, -0.05, 0.05) : 0.0;
}

std::int64_t job_clock::offset_ns(std::int64_t local) const {
  std::lock_guard<std::mutex> lock(m_);
  if (points_.empty()) return 0;
  return std::int64_t(a_ + b_ * double(local - t0_));
}

double job_clock::drift_ppm() const {
  std::lock_guard<std::mutex> lock(m_);
  return -b_ / (1 + b_) * 1e6;  // node 0's clock runs at 1 + b local seconds per local second
}

int job_clock::probes() const {
  std::lock_guard<std::mutex> lock(m_);
  return probes_;
}

double job_clock::probed_span_s() const {
  std::lock_guard<std::mutex> lock(m_);
  return points_.empty() ? 0.0 : double(points_.back().local_ns - first_probe_ns_) * 1e-9;
}

double job_clock::now_us() const {
  const auto local = local_ns();
  return double(local + offset_ns(local) - epoch_ns_) * 1e-3;
}

void write_chrome_trace(const std::string& path, const std::vector<trace_event>& events, int replicas,
                        int stages) {
  using nlohmann::json;
  json out = json::array();
  const int optimizer_pid = replicas;
  for (int r = 0; r < replicas; ++r) {
    out.push_back({{"ph", "M"}, {"name", "process_name"}, {"pid", r}, {"args", {{"name", "replica " + std::to_string(r)}}}});
    for (int k = 0; k < stages; ++k)
      out.push_back({{"ph", "M"}, {"name", "thread_name"}, {"pid", r}, {"tid", k}, {"args", {{"name", "stage " + std::to_string(k)}}}});
  }
  out.push_back({{"ph", "M"}, {"name", "process_name"}, {"pid", optimizer_pid}, {"args", {{"name", "optimizer shards"}}}});
  // Idle gaps between consecutive compute ops of a stage within a step.
  std::map<std::tuple<std::int64_t, int, int>, std::vector<const trace_event*>> by_track;
  for (const auto& e : events) {
    const bool compute = is_compute(e);
    json args{{"step", e.step}, {"stage", e.stage}, {"replica", e.replica}};
    if (e.bytes >= 0) args["bytes"] = e.bytes;
    if (compute || is_comm(e) || is_all_to_all(e) || is_tensor_parallel(e)) {
      args["mb"] = e.mb;
      args["chunk"] = e.chunk;
    } else if (e.chunk >= 0) {
      args["chunk"] = e.chunk;  // a chunk's collective (reduce-scatter of one of its buckets)
      if (e.mb >= 0) args["bucket"] = e.mb;
    }
    if (compute) {
      args["op"] = e.name;
      by_track[{e.step, e.replica, e.stage}].push_back(&e);
    }
    if (is_eval(e)) {  // on the stage's track, outside the steps' idle gaps
      out.push_back({{"ph", "X"}, {"name", "eval F" + std::to_string(e.mb)}, {"cat", "evaluation"}, {"pid", e.replica},
                     {"tid", e.stage}, {"ts", e.start_us}, {"dur", e.end_us - e.start_us},
                     {"args", {{"step", e.step}, {"stage", e.stage}, {"replica", e.replica}, {"forward", e.mb},
                               {"chunk", e.chunk}}}});
      continue;
    }
    if (is_all_to_all(e) || is_tensor_parallel(e)) {  // on the stage's track, within its op
      out.push_back({{"ph", "X"}, {"name", e.name}, {"cat", is_all_to_all(e) ? "all-to-all" : "tensor-parallel"},
                     {"pid", e.replica}, {"tid", e.stage}, {"ts", e.start_us}, {"dur", e.end_us - e.start_us},
                     {"args", args}});
      continue;
    }
    if (is_checkpoint(e)) {  // on the stage's track, between steps
      out.push_back({{"ph", "X"}, {"name", e.name}, {"cat", "checkpoint"}, {"pid", e.replica}, {"tid", e.stage},
                     {"ts", e.start_us}, {"dur", e.end_us - e.start_us}, {"args", args}});
      continue;
    }
    if (is_comm(e)) {  // on the stage's track: sends as slices, receives as instants
      json ev{{"name", e.name}, {"cat", "comm"}, {"pid", e.replica}, {"tid", e.stage}, {"ts", e.start_us}, {"args", args}};
      if (e.name[0] == 's') {
        ev["ph"] = "X";
        ev["dur"] = e.end_us - e.start_us;
      } else {
        ev["ph"] = "i";
        ev["s"] = "t";
      }
      out.push_back(std::move(ev));
      continue;
    }
    out.push_back({{"ph", "X"},
                   {"name", compute ? e.name + std::to_string(e.mb) : e.name},
                   {"cat", compute ? "compute" : "optimizer"},
                   {"pid", compute ? e.replica : optimizer_pid},
                   {"tid", compute ? e.stage : e.stage * replicas + e.replica},
                   {"ts", e.start_us},
                   {"dur", e.end_us - e.start_us},
                   {"args", args}});
  }
  for (auto& [key, evs] : by_track) {
    std::sort(evs.begin(), evs.end(), [](auto* a, auto* b) { return a->start_us < b->start_us; });
    for (std::size_t i = 1; i < evs.size(); ++i) {
      const double gap = evs[i]->start_us - evs[i - 1]->end_us;
      if (gap <= 0) continue;
      out.push_back({{"ph", "X"}, {"name", "idle"}, {"cat", "idle"}, {"pid", std::get<1>(key)}, {"tid", std::get<2>(key)},
                     {"ts", evs[i - 1]->end_us}, {"dur", gap}, {"args", {{"step", std::get<0>(key)}}}});
    }
  }
  write_file_atomically(path, json{{"traceEvents", out}, {"displayTimeUnit", "ms"}}.dump());
}

}  // namespace troupe
