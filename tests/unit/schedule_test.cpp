#include <gtest/gtest.h>

#include <sstream>

#include "compute/schedule/schedule.hpp"

namespace troupe {

namespace {
std::string row(const schedule& s, int r) {
  std::string out;
  for (const auto& op : s.ranks[r]) out += (out.empty() ? "" : " ") + to_string(op, s.chunks > 1);
  return out;
}
int leading_forwards(const std::vector<pipeline_op>& ops) {
  int n = 0;
  while (n < int(ops.size()) && ops[n].kind == op_kind::forward) ++n;
  return n;
}
}  // namespace

TEST(Schedule, OneFOneBWarmupIsMinOfRemainingStagesAndMicrobatches) {
  for (int p = 1; p <= 8; ++p)
    for (int m = 1; m <= 16; ++m) {
      const auto s = make_schedule(schedule_kind::one_f_one_b, p, m);
      for (int r = 0; r < p; ++r) {
        const int warmup = std::min(p - r - 1, m);
        // Warm-up forwards, then the steady phase starts with one more forward (if any left).
        EXPECT_EQ(leading_forwards(s.ranks[r]), warmup < m ? warmup + 1 : m) << "p=" << p << " m=" << m << " r=" << r;
      }
    }
}

TEST(Schedule, OneFOneBOrderOfFourStagesEightMicrobatches) {
  const auto s = make_schedule(schedule_kind::one_f_one_b, 4, 8);
  EXPECT_EQ(row(s, 0), "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7");
  EXPECT_EQ(row(s, 2), "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7");
  EXPECT_EQ(row(s, 3), "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7");
}

TEST(Schedule, GpipeIsFillThenDrain) {
  const auto s = make_schedule(schedule_kind::gpipe, 3, 4);
  for (int r = 0; r < 3; ++r) EXPECT_EQ(row(s, r), "F0 F1 F2 F3 B0 B1 B2 B3");
}

// Written out from reference/megatron-schedules.py.txt
// (forward_backward_pipelining_with_interleaving): p = 4, m = 8, v = 2. Rank r warms up
// with min((p - r - 1) * 2 + (v - 1) * p, m v) forwards; get_model_chunk_id picks the chunk
// of virtual micro-batch k: (k mod p v) / p, reversed for backwards; each chunk takes
// its micro-batches in order.
TEST(Schedule, InterleavedOrderEqualsMegatron) {
  const auto s = make_schedule(schedule_kind::interleaved, 4, 8, 2);
  EXPECT_EQ(row(s, 0),
            "F0.0 F1.0 F2.0 F3.0 F0.1 F1.1 F2.1 F3.1 F4.0 F5.0 F6.0 B0.1 F7.0 B1.1 F4.1 B2.1 "
            "F5.1 B3.1 F6.1 B0.0 F7.1 B1.0 B2.0 B3.0 B4.1 B5.1 B6.1 B7.1 B4.0 B5.0 B6.0 B7.0");
  EXPECT_EQ(row(s, 1),
            "F0.0 F1.0 F2.0 F3.0 F0.1 F1.1 F2.1 F3.1 F4.0 B0.1 F5.0 B1.1 F6.0 B2.1 F7.0 B3.1 "
            "F4.1 B0.0 F5.1 B1.0 F6.1 B2.0 F7.1 B3.0 B4.1 B5.1 B6.1 B7.1 B4.0 B5.0 B6.0 B7.0");
  EXPECT_EQ(row(s, 2),
            "F0.0 F1.0 F2.0 F3.0 F0.1 F1.1 F2.1 B0.1 F3.1 B1.1 F4.0 B2.1 F5.0 B3.1 F6.0 B0.0 "
            "F7.0 B1.0 F4.1 B2.0 F5.1 B3.0 F6.1 B4.1 F7.1 B5.1 B6.1 B7.1 B4.0 B5.0 B6.0 B7.0");
  EXPECT_EQ(row(s, 3),
            "F0.0 F1.0 F2.0 F3.0 F0.1 B0.1 F1.1 B1.1 F2.1 B2.1 F3.1 B3.1 F4.0 B0.0 F5.0 B1.0 "
            "F6.0 B2.0 F7.0 B3.0 F4.1 B4.1 F5.1 B5.1 F6.1 B6.1 F7.1 B7.1 B4.0 B5.0 B6.0 B7.0");
}

TEST(Schedule, InterleavedWithAsManyMicrobatchesAsStagesIsAllWarmup) {
  const auto s = make_schedule(schedule_kind::interleaved, 2, 2, 2);
  EXPECT_EQ(row(s, 0), "F0.0 F1.0 F0.1 F1.1 B0.1 B1.1 B0.0 B1.0");
  EXPECT_EQ(row(s, 1), "F0.0 F1.0 F0.1 F1.1 B0.1 B1.1 B0.0 B1.0");
}

// ZB-H1 written out by hand from its rule: 1f1b's F and B order (above), stage r runs W's
// only once more than r of them wait, and the rest at the end.
TEST(Schedule, ZeroBubbleOrderOfFourStagesEightMicrobatches) {
  const auto s = make_schedule(schedule_kind::zero_bubble, 4, 8);
  EXPECT_EQ(row(s, 0), "F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7");
  EXPECT_EQ(row(s, 2), "F0 F1 B0 F2 B1 F3 B2 W0 F4 B3 W1 F5 B4 W2 F6 B5 W3 F7 B6 W4 B7 W5 W6 W7");
  EXPECT_EQ(row(s, 3), "F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7");
  EXPECT_TRUE(s.split_backward());
  EXPECT_FALSE(make_schedule(schedule_kind::one_f_one_b, 4, 8).split_backward());
  EXPECT_EQ(parse_schedule_kind("zb-h1"), schedule_kind::zero_bubble);
  EXPECT_EQ(to_string(schedule_kind::zero_bubble), "zero-bubble");
  EXPECT_THROW(make_schedule(schedule_kind::zero_bubble, 4, 8, 2), schedule_error);  // no chunks
}

// The paper's figure for ZB-H1 with T_F = T_B = T_W: a bubble of (p - 1)(T_F + T_B - T_W)
// per stage, a third of 1f1b's (p - 1)(T_F + T_B + T_W), for m >= p. Its peak memory
// is 1f1b's worst stage's on every stage: p micro-batches.
TEST(Schedule, ZeroBubbleCutsTheSimulatedBubbleToAThird) {
  for (int p = 2; p <= 8; ++p)
    for (int m = p; m <= 16; ++m) {
      const auto zb = simulate(make_schedule(schedule_kind::zero_bubble, p, m), 1.0, 2.0, 1.0);
      const auto one = simulate(make_schedule(schedule_kind::one_f_one_b, p, m), 1.0, 2.0);
      EXPECT_DOUBLE_EQ(zb.makespan, 3.0 * m + (p - 1)) << p << " " << m;
      EXPECT_DOUBLE_EQ(one.makespan - 3.0 * m, 3.0 * (zb.makespan - 3.0 * m)) << p << " " << m;
      for (int r = 0; r < p; ++r) EXPECT_EQ(zb.peak_activations[r], std::min(p, m)) << p << " " << m << " " << r;
    }
  // Fewer micro-batches than stages: still shorter than 1f1b.
  EXPECT_LT(simulate(make_schedule(schedule_kind::zero_bubble, 8, 3)).makespan,
            simulate(make_schedule(schedule_kind::one_f_one_b, 8, 3)).makespan);
  // A weight pass free of cost is 1f1b with a shorter backward; costlier than it: refused.
  EXPECT_DOUBLE_EQ(simulate(make_schedule(schedule_kind::zero_bubble, 4, 8), 1.0, 2.0, 0.0).makespan,
                   simulate(make_schedule(schedule_kind::one_f_one_b, 4, 8), 1.0, 2.0).makespan);
  EXPECT_THROW(simulate(make_schedule(schedule_kind::zero_bubble, 4, 8), 1.0, 2.0, 3.0), schedule_error);
}

TEST(Schedule, EveryLegalScheduleValidates) {
  for (int p = 1; p <= 8; ++p)
    for (int m = 1; m <= 16; ++m) {
      EXPECT_EQ(validate(make_schedule(schedule_kind::gpipe, p, m)), "") << p << " " << m;
      EXPECT_EQ(validate(make_schedule(schedule_kind::one_f_one_b, p, m)), "") << p << " " << m;
      EXPECT_EQ(validate(make_schedule(schedule_kind::zero_bubble, p, m)), "") << p << " " << m;
      if (m % p != 0) continue;
      for (int v : {2, 3, 4})
        EXPECT_EQ(validate(make_schedule(schedule_kind::interleaved, p, m, v)), "") << p << " " << m << " " << v;
    }
}

TEST(Schedule, IllegalArgumentsAreRefused) {
  EXPECT_THROW(make_schedule(schedule_kind::interleaved, 4, 6, 2), schedule_error);
  EXPECT_THROW(make_schedule(schedule_kind::one_f_one_b, 4, 8, 2), schedule_error);
  EXPECT_THROW(make_schedule(schedule_kind::one_f_one_b, 0, 8), schedule_error);
  EXPECT_THROW(make_schedule(schedule_kind::gpipe, 2, 0), schedule_error);
  EXPECT_THROW(parse_schedule_kind("2f2b"), schedule_error);
}

TEST(Schedule, ValidatorFindsBrokenSchedules) {
  auto dup = make_schedule(schedule_kind::one_f_one_b, 2, 4);
  dup.ranks[1][0] = dup.ranks[1][2];  // an op twice, another never
  EXPECT_NE(validate(dup), "");
  auto early = make_schedule(schedule_kind::gpipe, 2, 2);
  std::swap(early.ranks[0][0], early.ranks[0][2]);  // B0 F1 F0 B1: B0 before its F0
  EXPECT_NE(validate(early).find("before its forward"), std::string::npos) << validate(early);
  // Cross-stage deadlock: stage 1 runs mb 1 first while stage 0 waits for B0 after F0.
  auto dead = make_schedule(schedule_kind::one_f_one_b, 2, 2);
  // stage 0: F0 F1 B0 B1 -> F0 B0 F1 B1 ; stage 1: F0 B0 F1 B1 -> F1 B1 F0 B0
  dead.ranks[0] = {{op_kind::forward, 0, 0}, {op_kind::backward, 0, 0}, {op_kind::forward, 1, 0}, {op_kind::backward, 1, 0}};
  dead.ranks[1] = {{op_kind::forward, 1, 0}, {op_kind::backward, 1, 0}, {op_kind::forward, 0, 0}, {op_kind::backward, 0, 0}};
  EXPECT_NE(validate(dead).find("deadlock"), std::string::npos) << validate(dead);
  EXPECT_THROW(simulate(dead), schedule_error);
  // Weight passes: before their backward, missing, or in a kind that does not split.
  auto w_early = make_schedule(schedule_kind::zero_bubble, 2, 2);
  std::swap(w_early.ranks[0][1], w_early.ranks[0][3]);  // F0 F1 B0 W0 ... -> F0 W0 B0 F1
  EXPECT_NE(validate(w_early).find("before its backward"), std::string::npos) << validate(w_early);
  auto w_missing = make_schedule(schedule_kind::zero_bubble, 2, 2);
  w_missing.ranks[1].pop_back();
  EXPECT_NE(validate(w_missing).find("never runs W1"), std::string::npos) << validate(w_missing);
  auto w_stray = make_schedule(schedule_kind::one_f_one_b, 2, 2);
  w_stray.ranks[1].push_back({op_kind::weight, 0, 0});
  EXPECT_NE(validate(w_stray).find("does not split"), std::string::npos) << validate(w_stray);
}

TEST(Schedule, SimulatedBubbleOfOneFOneBWithEqualCosts) {
  for (int p = 1; p <= 8; ++p)
    for (int m = 1; m <= 16; ++m) {
      const auto sim = simulate(make_schedule(schedule_kind::one_f_one_b, p, m), 1.0, 1.0);
      EXPECT_NEAR(sim.bubble, double(p - 1) / (m + p - 1), 1e-12) << p << " " << m;
      EXPECT_DOUBLE_EQ(sim.makespan, 2.0 * (m + p - 1));
    }
}

TEST(Schedule, PeakActivationsOfOneFOneBAreBoundedByStagesNotMicrobatches) {
  const auto one = simulate(make_schedule(schedule_kind::one_f_one_b, 4, 16));
  const auto fill = simulate(make_schedule(schedule_kind::gpipe, 4, 16));
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(one.peak_activations[r], 4 - r);
    EXPECT_EQ(fill.peak_activations[r], 16);
  }
  // Same bubble for gpipe and 1f1b; interleaving shrinks it.
  EXPECT_NEAR(one.bubble, fill.bubble, 1e-12);
  const auto inter = simulate(make_schedule(schedule_kind::interleaved, 4, 16, 2), 0.5, 1.0);
  EXPECT_LT(inter.bubble, one.bubble);
}

}  // namespace troupe
