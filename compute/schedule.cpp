#include "compute/schedule.hpp"

#include <algorithm>

namespace troupe {

std::string to_string(schedule_kind k) {
  switch (k) {
    case schedule_kind::gpipe: return "gpipe";
    case schedule_kind::one_f_one_b: return "1f1b";
    case schedule_kind::interleaved: return "interleaved-1f1b";
    case schedule_kind::zero_bubble: return "zero-bubble";
  }
  return "?";
}

schedule_kind parse_schedule_kind(const std::string& s) {
  if (s == "gpipe") return schedule_kind::gpipe;
  if (s == "1f1b") return schedule_kind::one_f_one_b;
  if (s == "interleaved-1f1b" || s == "interleaved") return schedule_kind::interleaved;
  if (s == "zero-bubble" || s == "zb-h1") return schedule_kind::zero_bubble;
  throw schedule_error("unknown schedule kind '" + s + "' (expected gpipe, 1f1b, interleaved-1f1b or zero-bubble)");
}

const char* op_letter(op_kind k) { return k == op_kind::forward ? "F" : k == op_kind::backward ? "B" : "W"; }

std::string to_string(const pipeline_op& op, bool with_chunk) {
  std::string s = op_letter(op.kind) + std::to_string(op.mb);
  if (with_chunk) s += "." + std::to_string(op.chunk);
  return s;
}

namespace {

void gpipe(schedule& s) {
  for (auto& ops : s.ranks) {
    for (int i = 0; i < s.microbatches; ++i) ops.push_back({op_kind::forward, i, 0});
    for (int i = 0; i < s.microbatches; ++i) ops.push_back({op_kind::backward, i, 0});
  }
}

// Megatron's forward_backward_pipelining_without_interleaving.
void one_f_one_b(schedule& s) {
  const int p = s.stages, m = s.microbatches;
  for (int r = 0; r < p; ++r) {
    auto& ops = s.ranks[r];
    const int warmup = std::min(p - r - 1, m);
    const int remaining = m - warmup;
    for (int i = 0; i < warmup; ++i) ops.push_back({op_kind::forward, i, 0});
    for (int i = 0; i < remaining; ++i) {
      ops.push_back({op_kind::forward, warmup + i, 0});
      ops.push_back({op_kind::backward, i, 0});
    }
    for (int i = remaining; i < m; ++i) ops.push_back({op_kind::backward, i, 0});
  }
}

// ZB-H1: 1f1b's F and B order; stage r lets its W's trail its B's by up to r and runs
// the rest at the end (the last B's travel back one stage at a time, so stage r runs its
// last B about r B's before stage 0 does: its r kept W's fill that time). Stage r holds
// at most (p - r) + r = p micro-batches' activations (1f1b's stage 0 peak).
void zero_bubble(schedule& s) {
  one_f_one_b(s);
  for (int r = 0; r < s.stages; ++r) {
    std::vector<pipeline_op> ops;
    int next_w = 0, backwards = 0;
    for (const auto& op : s.ranks[r]) {
      ops.push_back(op);
      if (op.kind != op_kind::backward) continue;
      if (++backwards - next_w > r) ops.push_back({op_kind::weight, next_w++, 0});
    }
    while (next_w < s.microbatches) ops.push_back({op_kind::weight, next_w++, 0});
    s.ranks[r] = std::move(ops);
  }
}

// Megatron's forward_backward_pipelining_with_interleaving. Virtual micro-batch k (of
// m * v) runs chunk get_model_chunk_id(k); chunks take their micro-batches in order, so
// k's micro-batch is (k / (p v)) * p + k % p.
void interleaved(schedule& s) {
  const int p = s.stages, m = s.microbatches, v = s.chunks;
  const int total = m * v;
  const int group = p * v;
  auto chunk_of = [&](int k, bool forward) {
    const int c = (k % group) / p;
    return forward ? c : v - c - 1;
  };
  auto mb_of = [&](int k) { return (k / group) * p + k % p; };
  auto fwd = [&](int k) { return pipeline_op{op_kind::forward, mb_of(k), chunk_of(k, true)}; };
  auto bwd = [&](int k) { return pipeline_op{op_kind::backward, mb_of(k), chunk_of(k, false)}; };
  for (int r = 0; r < p; ++r) {
    auto& ops = s.ranks[r];
    int warmup;
    if (m == p) {
      warmup = total;  // all warm-up: every forward, then every backward
    } else {
      warmup = std::min((p - r - 1) * 2 + (v - 1) * p, total);
    }
    const int remaining = total - warmup;
    for (int k = 0; k < warmup; ++k) ops.push_back(fwd(k));
    for (int k = 0; k < remaining; ++k) {
      ops.push_back(fwd(warmup + k));
      ops.push_back(bwd(k));
    }
    for (int k = remaining; k < total; ++k) ops.push_back(bwd(k));
  }
}

}  // namespace

schedule make_schedule(schedule_kind kind, int stages, int microbatches, int chunks) {
  if (stages < 1) throw schedule_error("stages must be >= 1 (got " + std::to_string(stages) + ")");
  if (microbatches < 1)
    throw schedule_error("microbatches must be >= 1 (got " + std::to_string(microbatches) + ")");
  if (chunks < 1) throw schedule_error("chunks must be >= 1 (got " + std::to_string(chunks) + ")");
  if (kind != schedule_kind::interleaved && chunks != 1)
    throw schedule_error(to_string(kind) + " takes no virtual chunks (got --chunks " +
                         std::to_string(chunks) + "); use interleaved-1f1b");
  if (kind == schedule_kind::interleaved && microbatches % stages != 0)
    throw schedule_error("interleaved-1f1b needs microbatches (" + std::to_string(microbatches) +
                         ") to be a multiple of stages (" + std::to_string(stages) + ")");
  schedule s;
  s.kind = kind;
  s.stages = stages;
  s.microbatches = microbatches;
  s.chunks = chunks;
  s.ranks.resize(stages);
  for (auto& r : s.ranks) r.reserve(std::size_t(3) * microbatches * chunks);
  switch (kind) {
    case schedule_kind::gpipe: gpipe(s); break;
    case schedule_kind::one_f_one_b: one_f_one_b(s); break;
    case schedule_kind::interleaved: interleaved(s); break;
    case schedule_kind::zero_bubble: zero_bubble(s); break;
  }
  return s;
}

}  // namespace troupe
