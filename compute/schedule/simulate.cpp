// Validator and simulator of pipeline schedules: an event-driven replay of every stage's
// order in which an op starts when its stage is free and its inputs exist.
#include <algorithm>
#include <sstream>

#include "compute/schedule/timed_simulation.hpp"

namespace troupe {

namespace {

/// Replays `s`; calls on_op(stage, index, start, end) for every op (for an F&B pair: for
/// both, with the pair's times). Returns an empty string, or a description of the
/// deadlock. cost(stage, op) is one op's time, pair_cost(stage, first, second) a pair's,
/// transfer(from, to) the time a tensor takes from virtual stage `from` to `to`.
template <class Cost, class PairCost, class Transfer, class OnOp>
std::string replay(const schedule& s, Cost cost, PairCost pair_cost, Transfer transfer, OnOp on_op) {
  const int p = s.stages, m = s.microbatches, n_virtual = s.virtual_stages();
  std::vector<double> f_end(std::size_t(n_virtual) * m, -1.0), b_end(std::size_t(n_virtual) * m, -1.0);
  std::vector<std::size_t> next(p, 0);
  std::vector<double> free_at(p, 0.0);
  std::size_t remaining = 0;
  for (const auto& ops : s.ranks) remaining += ops.size();
  // When `op` of stage r can start (its inputs exist), or < 0.
  auto ready_at = [&](int r, const pipeline_op& op) {
    const int x = s.virtual_stage(r, op.chunk);
    const std::size_t here = std::size_t(x) * m + op.mb;
    if (op.kind == op_kind::forward) {
      if (x == 0) return 0.0;
      return f_end[here - m] < 0 ? -1.0 : f_end[here - m] + transfer(x - 1, x);
    }
    if (op.kind == op_kind::weight) return b_end[here];
    if (f_end[here] < 0) return -1.0;
    if (x == n_virtual - 1) return f_end[here];
    return b_end[here + m] < 0 ? -1.0 : std::max(f_end[here], b_end[here + m] + transfer(x + 1, x));
  };
  auto finish = [&](int r, const pipeline_op& op, double end) {
    const std::size_t here = std::size_t(s.virtual_stage(r, op.chunk)) * m + op.mb;
    if (op.kind == op_kind::forward) f_end[here] = end;
    if (op.kind == op_kind::backward) b_end[here] = end;
  };
  while (remaining > 0) {
    bool progressed = false;
    for (int r = 0; r < p; ++r) {
      const auto& ops = s.ranks[r];
      while (next[r] < ops.size()) {
        const auto& op = ops[next[r]];
        const bool pair = op.paired && next[r] + 1 < ops.size();
        double ready = ready_at(r, op);
        if (ready < 0) break;
        if (pair) {
          const double second = ready_at(r, ops[next[r] + 1]);
          if (second < 0) break;
          ready = std::max(ready, second);
        }
        const double start = std::max(free_at[r], ready);
        const double end = start + (pair ? pair_cost(r, op, ops[next[r] + 1]) : cost(r, op));
        const std::size_t n = pair ? 2 : 1;
        for (std::size_t i = 0; i < n; ++i) {
          finish(r, ops[next[r]], end);
          on_op(r, next[r], start, end);
          ++next[r];
          --remaining;
        }
        free_at[r] = end;
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

/// replay with every op costing 1.
template <class OnOp>
std::string replay_unit(const schedule& s, OnOp on_op) {
  return replay(
      s, [](int, const pipeline_op&) { return 1.0; }, [](int, const pipeline_op&, const pipeline_op&) { return 1.0; },
      [](int, int) { return 0.0; }, on_op);
}

}  // namespace

std::string validate(const schedule& s) {
  if (s.stages < 1 || s.microbatches < 1 || s.chunks < 1) return "empty schedule";
  if (static_cast<int>(s.ranks.size()) != s.stages)
    return "schedule has " + std::to_string(s.ranks.size()) + " rank lists for " +
           std::to_string(s.stages) + " stages";
  if (s.v_shape() && s.chunks != 2) return to_string(s.kind) + " places 2 chunks per stage";
  const int m = s.microbatches;
  for (int r = 0; r < s.stages; ++r) {
    const std::size_t n = std::size_t(s.chunks) * m;
    std::vector<int> seen_f(n, 0), seen_b(n, 0), seen_w(n, 0), split(n, 0);
    const std::string stage = "stage " + std::to_string(r);
    const auto& ops = s.ranks[r];
    for (std::size_t k = 0; k < ops.size(); ++k) {
      const auto& op = ops[k];
      if (op.mb < 0 || op.mb >= m || op.chunk < 0 || op.chunk >= s.chunks)
        return stage + " has out-of-range op " + to_string(op, true);
      const auto i = std::size_t(op.chunk) * m + op.mb;
      auto& seen = op.kind == op_kind::forward ? seen_f : op.kind == op_kind::backward ? seen_b : seen_w;
      if (seen[i]++) return stage + " runs " + to_string(op, true) + " twice";
      if (op.kind == op_kind::backward && !seen_f[i]) return stage + " runs " + to_string(op, true) + " before its forward";
      if (op.split && op.kind != op_kind::backward) return stage + " marks " + to_string(op, true) + " split";
      if (op.split && !s.split_backward())
        return stage + " splits " + to_string(op, true) + ", but " + to_string(s.kind) + " does not split the backward";
      if (op.kind == op_kind::backward) split[i] = op.split;
      if (op.kind == op_kind::weight && !s.split_backward())
        return stage + " runs " + to_string(op, true) + ", but " + to_string(s.kind) + " does not split the backward";
      if (op.kind == op_kind::weight && !seen_b[i])
        return stage + " runs " + to_string(op, true) + " before its backward";
      if (op.kind == op_kind::weight && !split[i])
        return stage + " runs " + to_string(op, true) + ", but its backward was not split";
      if (op.paired) {
        if (k + 1 == ops.size()) return stage + " pairs its last op " + to_string(op, true) + " with nothing";
        const auto& other = ops[k + 1];
        if (op.kind != op_kind::forward || other.kind != op_kind::backward || other.paired)
          return stage + " pairs " + to_string(op, true) + " with " + to_string(other, true) +
                 ": a pair is one forward and one backward";
      }
    }
    for (std::size_t i = 0; i < n; ++i) {
      const char* missing = !seen_f[i] ? "F" : !seen_b[i] ? "B" : split[i] && !seen_w[i] ? "W" : nullptr;
      if (missing) return stage + " never runs " + missing + std::to_string(i % m) + "." + std::to_string(i / m);
    }
  }
  return replay_unit(s, [](int, std::size_t, double, double) {});
}

std::vector<std::pair<int, std::size_t>> execution_order(const schedule& s) {
  std::vector<std::pair<int, std::size_t>> order;
  const auto error = replay_unit(s, [&](int r, std::size_t i, double, double) { order.emplace_back(r, i); });
  if (!error.empty()) throw schedule_error(error);
  return order;
}

namespace {
/// The weight part of a backward: none in kinds without W ops, half by default.
double weight_part(const schedule& s, const op_costs& c) {
  return !s.split_backward() ? 0 : c.weight < 0 ? c.backward / 2 : c.weight;
}
}  // namespace

double compute_cost(const schedule& s, const op_costs& c, const pipeline_op& op) {
  const double w = weight_part(s, c);
  if (op.kind == op_kind::forward) return c.forward;
  if (op.kind == op_kind::weight) return w;
  return op.split ? c.backward - w : c.backward;
}

simulation simulate(const schedule& s, const op_costs& costs) {
  op_costs c = costs;
  c.weight = weight_part(s, costs);
  for (double x : {c.forward, c.backward, c.weight, c.alltoall})
    if (x < 0) throw schedule_error("simulated costs must not be negative");
  if (c.weight > c.backward) {
    std::ostringstream why;
    why << "the weight pass's cost (" << c.weight << ") exceeds the backward's (" << c.backward << ")";
    throw schedule_error(why.str());
  }
  auto compute = [&](const pipeline_op& op) { return compute_cost(s, c, op); };
  timed_costs t;
  t.op = [&](int, const pipeline_op& op) { return compute(op) + (op.kind == op_kind::weight ? 0.0 : c.alltoall); };
  t.pair = [&](int, const pipeline_op& a, const pipeline_op& b) {
    return c.pair >= 0 ? c.pair : std::max(compute(a) + compute(b), 2 * c.alltoall);
  };
  return simulate(s, t);
}

simulation simulate(const schedule& s, const timed_costs& c) {
  if (!c.op) throw schedule_error("simulate: no op costs");
  auto cost = [&](int r, const pipeline_op& op) {
    const double x = c.op(r, op);
    if (x < 0) throw schedule_error("simulated costs must not be negative");
    return x;
  };
  auto pair_cost = [&](int r, const pipeline_op& a, const pipeline_op& b) {
    return c.pair ? c.pair(r, a, b) : cost(r, a) + cost(r, b);
  };
  auto transfer = [&](int from, int to) { return c.transfer ? c.transfer(from, to) : 0.0; };
  simulation out;
  out.busy.assign(s.stages, 0.0);
  out.peak_activations.assign(s.stages, 0);
  out.times.resize(s.stages);
  for (int r = 0; r < s.stages; ++r) out.times[r].resize(s.ranks[r].size());
  const auto error = replay(s, cost, pair_cost, transfer, [&](int r, std::size_t i, double start, double end) {
    const bool second_of_pair = i > 0 && s.ranks[r][i - 1].paired;
    out.times[r][i] = {start, end};
    if (!second_of_pair) out.busy[r] += end - start;
    out.makespan = std::max(out.makespan, end);
  });
  if (!error.empty()) throw schedule_error(error);
  // Activations in flight: forwards run minus backwards finished, in each stage's order.
  for (int r = 0; r < s.stages; ++r) {
    int live = 0;
    for (const auto& op : s.ranks[r]) {
      const bool frees = op.kind == op_kind::weight || (op.kind == op_kind::backward && !op.split);
      live += op.kind == op_kind::forward ? 1 : frees ? -1 : 0;
      out.peak_activations[r] = std::max(out.peak_activations[r], live);
    }
  }
  double busy = 0;
  for (double x : out.busy) busy += x;
  for (double x : out.busy) out.idle.push_back(out.makespan - x);
  out.bubble = out.makespan > 0 ? 1.0 - busy / (s.stages * out.makespan) : 0.0;
  return out;
}

simulation simulate(const schedule& s, double f, double b, double w) {
  op_costs c;
  c.forward = f;
  c.backward = b;
  c.weight = w;
  return simulate(s, c);
}

}  // namespace troupe
