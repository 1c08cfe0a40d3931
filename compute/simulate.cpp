// Validator and simulator of pipeline schedules: an event-driven replay of every stage's
// order in which an op starts when its stage is free and its inputs exist.
#include <algorithm>
#include <sstream>

#include "compute/schedule.hpp"

namespace troupe {

namespace {

/// Replays `s`; calls on_op(stage, index, start, end) for every op. Returns an empty
/// string, or a description of the deadlock.
/// Op costs: forward f, backward b (the input's gradient only, for split backwards), weight w.
template <class OnOp>
std::string replay(const schedule& s, double f, double b, double w, OnOp on_op) {
  const int p = s.stages, m = s.microbatches, n_virtual = s.stages * s.chunks;
  std::vector<double> f_end(std::size_t(n_virtual) * m, -1.0), b_end(std::size_t(n_virtual) * m, -1.0);
  std::vector<std::size_t> next(p, 0);
  std::vector<double> free_at(p, 0.0);
  std::size_t remaining = 0;
  for (const auto& ops : s.ranks) remaining += ops.size();
  while (remaining > 0) {
    bool progressed = false;
    for (int r = 0; r < p; ++r) {
      const auto& ops = s.ranks[r];
      while (next[r] < ops.size()) {
        const auto& op = ops[next[r]];
        const int x = op.chunk * p + r;
        const std::size_t here = std::size_t(x) * m + op.mb;
        double ready = 0;
        if (op.kind == op_kind::forward) {
          if (x > 0) {
            ready = f_end[here - m];
            if (ready < 0) break;
          }
        } else if (op.kind == op_kind::weight) {
          ready = b_end[here];
          if (ready < 0) break;
        } else {
          ready = f_end[here];
          if (ready < 0) break;
          if (x < n_virtual - 1) {
            if (b_end[here + m] < 0) break;
            ready = std::max(ready, b_end[here + m]);
          }
        }
        const double start = std::max(free_at[r], ready);
        const double end = start + (op.kind == op_kind::forward ? f : op.kind == op_kind::backward ? b : w);
        if (op.kind == op_kind::forward) f_end[here] = end;
        if (op.kind == op_kind::backward) b_end[here] = end;
        free_at[r] = end;
        on_op(r, next[r], start, end);
        ++next[r];
        --remaining;
        progressed = true;
      }
    }
    if (!progressed) {
      std::ostringstream why;
      why << "deadlock: no stage can run its next op (";
      bool first = true;
      for (int r = 0; r < p; ++r)
        if (next[r] < s.ranks[r].size()) {
          why << (first ? "" : ", ") << "stage " << r << " waits at "
              << to_string(s.ranks[r][next[r]], s.chunks > 1);
          first = false;
        }
      why << ")";
      return why.str();
    }
  }
  return {};
}

}  // namespace

std::string validate(const schedule& s) {
  if (s.stages < 1 || s.microbatches < 1 || s.chunks < 1) return "empty schedule";
  if (static_cast<int>(s.ranks.size()) != s.stages)
    return "schedule has " + std::to_string(s.ranks.size()) + " rank lists for " +
           std::to_string(s.stages) + " stages";
  const int m = s.microbatches;
  for (int r = 0; r < s.stages; ++r) {
    const std::size_t n = std::size_t(s.chunks) * m;
    std::vector<int> seen_f(n, 0), seen_b(n, 0), seen_w(n, 0);
    const std::string stage = "stage " + std::to_string(r);
    for (const auto& op : s.ranks[r]) {
      if (op.mb < 0 || op.mb >= m || op.chunk < 0 || op.chunk >= s.chunks)
        return stage + " has out-of-range op " + to_string(op, true);
      const auto i = std::size_t(op.chunk) * m + op.mb;
      auto& seen = op.kind == op_kind::forward ? seen_f : op.kind == op_kind::backward ? seen_b : seen_w;
      if (seen[i]++) return stage + " runs " + to_string(op, true) + " twice";
      if (op.kind == op_kind::backward && !seen_f[i]) return stage + " runs " + to_string(op, true) + " before its forward";
      if (op.kind == op_kind::weight && !s.split_backward())
        return stage + " runs " + to_string(op, true) + ", but " + to_string(s.kind) + " does not split the backward";
      if (op.kind == op_kind::weight && !seen_b[i])
        return stage + " runs " + to_string(op, true) + " before its backward";
    }
    for (std::size_t i = 0; i < n; ++i) {
      const char* missing = !seen_f[i] ? "F" : !seen_b[i] ? "B" : s.split_backward() && !seen_w[i] ? "W" : nullptr;
      if (missing) return stage + " never runs " + missing + std::to_string(i % m) + "." + std::to_string(i / m);
    }
  }
  return replay(s, 1.0, 1.0, 1.0, [](int, std::size_t, double, double) {});
}

std::vector<std::pair<int, std::size_t>> execution_order(const schedule& s) {
  std::vector<std::pair<int, std::size_t>> order;
  const auto error =
      replay(s, 1.0, 1.0, 1.0, [&](int r, std::size_t i, double, double) { order.emplace_back(r, i); });
  if (!error.empty()) throw schedule_error(error);
  return order;
}

simulation simulate(const schedule& s, double f, double b, double w) {
  if (!s.split_backward()) {
    w = 0;  // no W ops: B is the whole backward
  } else if (w < 0) {
    w = b / 2;
  } else if (w > b) {
    std::ostringstream why;
    why << "the weight pass's cost (" << w << ") exceeds the backward's (" << b << ")";
    throw schedule_error(why.str());
  }
  simulation out;
  out.busy.assign(s.stages, 0.0);
  out.peak_activations.assign(s.stages, 0);
  out.times.resize(s.stages);
  for (int r = 0; r < s.stages; ++r) out.times[r].resize(s.ranks[r].size());
  const auto error = replay(s, f, b - w, w, [&](int r, std::size_t i, double start, double end) {
    out.times[r][i] = {start, end};
    out.busy[r] += end - start;
    out.makespan = std::max(out.makespan, end);
  });
  if (!error.empty()) throw schedule_error(error);
  // Activations in flight: forwards run minus backwards finished, in each stage's order.
  const op_kind last = s.split_backward() ? op_kind::weight : op_kind::backward;
  for (int r = 0; r < s.stages; ++r) {
    int live = 0;
    for (const auto& op : s.ranks[r]) {
      live += op.kind == op_kind::forward ? 1 : op.kind == last ? -1 : 0;
      out.peak_activations[r] = std::max(out.peak_activations[r], live);
    }
  }
  double busy = 0;
  for (double x : out.busy) busy += x;
  out.bubble = out.makespan > 0 ? 1.0 - busy / (s.stages * out.makespan) : 0.0;
  return out;
}

}  // namespace troupe
