#include "compute/schedule/schedule.hpp"

#include <algorithm>

namespace troupe {

std::string to_string(schedule_kind k) {
  switch (k) {
    case schedule_kind::gpipe: return "gpipe";
    case schedule_kind::one_f_one_b: return "1f1b";
    case schedule_kind::interleaved: return "interleaved-1f1b";
    case schedule_kind::zero_bubble: return "zero-bubble";
    case schedule_kind::combined_1f1b: return "combined-1f1b";
    case schedule_kind::zbv: return "zbv";
    case schedule_kind::dualpipev: return "dualpipev";
  }
  return "?";
}

std::string schedule_kind_names() {
  return "gpipe, 1f1b, interleaved-1f1b, zero-bubble, combined-1f1b, zbv or dualpipev";
}

schedule_kind parse_schedule_kind(const std::string& s) {
  if (s == "gpipe") return schedule_kind::gpipe;
  if (s == "1f1b") return schedule_kind::one_f_one_b;
  if (s == "interleaved-1f1b" || s == "interleaved") return schedule_kind::interleaved;
  if (s == "zero-bubble" || s == "zb-h1") return schedule_kind::zero_bubble;
  if (s == "combined-1f1b") return schedule_kind::combined_1f1b;
  if (s == "zbv" || s == "zb-v") return schedule_kind::zbv;
  if (s == "dualpipev") return schedule_kind::dualpipev;
  throw schedule_error("unknown schedule kind '" + s + "' (expected " + schedule_kind_names() + ")");
}

int default_chunks(schedule_kind k) { return k == schedule_kind::zbv || k == schedule_kind::dualpipev ? 2 : 1; }

int schedule::ops_of_chunk(int stage, int chunk) const {
  int n = 0;
  for (const auto& op : ranks.at(stage)) n += op.chunk == chunk;
  return n;
}

const char* op_letter(op_kind k) { return k == op_kind::forward ? "F" : k == op_kind::backward ? "B" : "W"; }

std::string to_string(const pipeline_op& op, bool with_chunk) {
  std::string s = op_letter(op.kind) + std::to_string(op.mb);
  if (with_chunk) s += "." + std::to_string(op.chunk);
  return s;
}

std::string order_text(const schedule& s, int stage) {
  std::string out;
  bool joined = false;
  for (const auto& op : s.ranks.at(stage)) {
    out += (out.empty() ? "" : joined ? "&" : " ") + to_string(op, s.chunks > 1);
    joined = op.paired;
  }
  return out;
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
    for (auto op : s.ranks[r]) {
      op.split = op.kind == op_kind::backward;
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
// k's micro-batch is (k / (p v)) * p + k % p. `combined`: Megatron-Core's combined 1F1B
// (combined_1f1b_schedule_for_interleaved_pipelining): one more warm-up forward, and each
// steady forward paired with its backward.
void interleaved(schedule& s, bool combined = false) {
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
      warmup = std::min((p - r - 1) * 2 + (v - 1) * p + (combined ? 1 : 0), total);
    }
    const int remaining = total - warmup;
    for (int k = 0; k < warmup; ++k) ops.push_back(fwd(k));
    for (int k = 0; k < remaining; ++k) {
      ops.push_back(fwd(warmup + k));
      ops.back().paired = combined;
      ops.push_back(bwd(k));
    }
    for (int k = remaining; k < total; ++k) ops.push_back(bwd(k));
  }
}

// Appends a stage's ops with per-chunk micro-batch counters: each chunk runs its forwards,
// backwards and weight passes in micro-batch order (the V kinds' rule).
struct v_builder {
  explicit v_builder(std::vector<pipeline_op>& into) : ops(into) {}
  std::vector<pipeline_op>& ops;
  int f[2] = {0, 0}, b[2] = {0, 0};
  std::vector<std::pair<int, int>> waiting_w;  // (mb, chunk) of split backwards, oldest first
  std::size_t next_w = 0;

  void forward(int c, bool paired = false) { ops.push_back({op_kind::forward, f[c]++, c, false, paired}); }
  void backward(int c, bool split) {
    if (split) waiting_w.emplace_back(b[c], c);
    ops.push_back({op_kind::backward, b[c]++, c, split, false});
  }
  /// The oldest split backward's weight pass (DualPipe's WeightGradStore is a FIFO).
  void weight() {
    const auto [mb, c] = waiting_w.at(next_w++);
    ops.push_back({op_kind::weight, mb, c});
  }
  /// The weight pass of chunk c's next split backward not yet weighted, in order.
  void weight_of(int c) {
    for (std::size_t i = next_w; i < waiting_w.size(); ++i)
      if (waiting_w[i].second == c) {
        ops.push_back({op_kind::weight, waiting_w[i].first, c});
        waiting_w.erase(waiting_w.begin() + std::ptrdiff_t(i));
        return;
      }
    throw std::logic_error("no split backward of chunk " + std::to_string(c) + " waits for its W");
  }
  void weights_left() {
    while (next_w < waiting_w.size()) weight();
  }
  /// Whether a split backward of chunk c still waits for its W.
  bool waiting(int c) const {
    for (std::size_t i = next_w; i < waiting_w.size(); ++i)
      if (waiting_w[i].second == c) return true;
    return false;
  }
};

// ZB-V as the paper draws it (F = B = W). Stage r:
//   warm-up   2 (p - r) - 1 forwards of chunk 0; r times F1 F0; p - r times F1 B1 W1
//   steady    F0 (while chunk 0 has micro-batches) B0 W0 F1 B1 W1, until chunk 1's
//             forwards catch up (m - p rounds)
//   cool-down r times B0 B1; p - r times B0 W0; then the W's left, chunk 1's first.
// A stage holds at most 2p chunk activations: 1f1b's p micro-batches of a whole stage.
void zbv(schedule& s) {
  const int p = s.stages, m = s.microbatches;
  for (int r = 0; r < p; ++r) {
    v_builder v(s.ranks[r]);
    for (int i = 0; i < 2 * (p - r) - 1; ++i) v.forward(0);
    for (int i = 0; i < r; ++i) {
      v.forward(1);
      v.forward(0);
    }
    for (int i = 0; i < p - r; ++i) {
      v.forward(1);
      v.backward(1, true);
      v.weight_of(1);
    }
    while (v.f[1] < m) {
      if (v.f[0] < m) v.forward(0);
      v.backward(0, true);
      v.weight_of(0);
      v.forward(1);
      v.backward(1, true);
      v.weight_of(1);
    }
    for (int i = 0; i < r; ++i) {
      v.backward(0, true);
      v.backward(1, true);
    }
    for (int i = 0; i < p - r; ++i) {
      v.backward(0, true);
      v.weight_of(0);
    }
    while (v.waiting(1)) v.weight_of(1);  // chunk 1's W's, then chunk 0's
    while (v.waiting(0)) v.weight_of(0);
  }
}

// DualPipeV: the reference's DualPipeV.step (reference/dualpipe-dualpipev.py.txt), its
// eight steps per rank r of p with n micro-batches ("chunk" 0 and 1 are its phases):
//   1  2 (p - r - 1) x F0
//   2  r + 1 x F0 F1
//   3  p - r - 1 x B1 (split) W F1
//   4  n - 2p + r + 1 x F0&B1 F1&B0 (the last rank's first F0 and B1 not overlapped)
//   5  p - r - 1 x B1 F1&B0
//   6  r + 1 x B1 B0 (split from the middle on: odd ranks from its B1, even from its B0)
//   7  p - r - 1 x W B0 (split)
//   8  r + 1 x W
// Every W takes the oldest split backward's weights. Pairs' backwards are whole.
void dualpipev(schedule& s) {
  const int p = s.stages, n = s.microbatches;
  for (int r = 0; r < p; ++r) {
    v_builder v(s.ranks[r]);
    for (int i = 0; i < 2 * (p - r - 1); ++i) v.forward(0);
    for (int i = 0; i < r + 1; ++i) {
      v.forward(0);
      v.forward(1);
    }
    for (int i = 0; i < p - r - 1; ++i) {
      v.backward(1, true);
      v.weight();
      v.forward(1);
    }
    for (int i = 0; i < n - 2 * p + r + 1; ++i) {
      const bool alone = i == 0 && r == p - 1;
      v.forward(0, !alone);
      v.backward(1, false);
      v.forward(1, true);
      v.backward(0, false);
    }
    for (int i = 0; i < p - r - 1; ++i) {
      v.backward(1, false);
      v.forward(1, true);
      v.backward(0, false);
    }
    bool split = false;
    for (int i = 0; i < r + 1; ++i) {
      if (i == (r + 1) / 2 && r % 2 == 1) split = true;
      v.backward(1, split);
      if (i == (r + 1) / 2 && r % 2 == 0) split = true;
      v.backward(0, split);
    }
    for (int i = 0; i < p - r - 1; ++i) {
      v.weight();
      v.backward(0, true);
    }
    v.weights_left();
    if (v.ops.size() != std::size_t(4 * n) + v.waiting_w.size())
      throw std::logic_error("dualpipev generated a wrong number of ops");
  }
}

}  // namespace

schedule make_schedule(schedule_kind kind, int stages, int microbatches, int chunks) {
  if (stages < 1) throw schedule_error("stages must be >= 1 (got " + std::to_string(stages) + ")");
  if (microbatches < 1)
    throw schedule_error("microbatches must be >= 1 (got " + std::to_string(microbatches) + ")");
  if (chunks == 0) chunks = default_chunks(kind);
  if (chunks < 1) throw schedule_error("chunks must be >= 1 (got " + std::to_string(chunks) + ")");
  const bool looped = kind == schedule_kind::interleaved || kind == schedule_kind::combined_1f1b;
  const bool v_kind = kind == schedule_kind::zbv || kind == schedule_kind::dualpipev;
  const std::string name = to_string(kind), m = std::to_string(microbatches), p = std::to_string(stages);
  if (!looped && !v_kind && chunks != 1)
    throw schedule_error(name + " takes no virtual chunks (got --chunks " + std::to_string(chunks) +
                         "); use interleaved-1f1b");
  if (v_kind && chunks != 2)
    throw schedule_error(name + " runs 2 chunks per stage in a V (stage r holds virtual stages r and 2p-1-r); got "
                         "chunks " + std::to_string(chunks) + ": set chunks = 2");
  if (looped && microbatches % stages != 0)
    throw schedule_error(name + " needs microbatches (" + m + ") to be a multiple of stages (" + p + ")");
  if (kind == schedule_kind::combined_1f1b && stages > 1 && chunks < 2)
    throw schedule_error("combined-1f1b with " + p + " pipeline stages needs at least 2 virtual chunks per stage "
                         "(as Megatron-Core's): set chunks >= 2");
  if (kind == schedule_kind::dualpipev && microbatches < 2 * stages)
    throw schedule_error("dualpipev needs at least 2p = " + std::to_string(2 * stages) + " micro-batches on " + p +
                         " stages (got " + m + ")");
  if (kind == schedule_kind::zbv && microbatches < 2 * stages - 1)
    throw schedule_error("zbv needs at least 2p - 1 = " + std::to_string(2 * stages - 1) + " micro-batches on " + p +
                         " stages (got " + m + ")");
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
    case schedule_kind::combined_1f1b: interleaved(s, true); break;
    case schedule_kind::zbv: zbv(s); break;
    case schedule_kind::dualpipev: dualpipev(s); break;
  }
  return s;
}

}  // namespace troupe
