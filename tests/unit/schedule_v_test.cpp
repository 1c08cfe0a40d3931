// The schedules of the expert-parallel issue as data: combined-1f1b, ZB-V and DualPipeV.
// Orders written out by hand from their rules (docs/schedules.md), the simulator checked
// against the papers' bubble formulas, and the drawing checked by parsing it.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

#include "actors/timeline_svg.hpp"
#include "actors/trace.hpp"
#include "compute/schedule/schedule.hpp"

namespace troupe {

namespace {

op_costs costs(double f, double b, double w, double pair = -1, double alltoall = 0) {
  op_costs c;
  c.forward = f;
  c.backward = b;
  c.weight = w;
  c.pair = pair;
  c.alltoall = alltoall;
  return c;
}

int most(const std::vector<int>& v) { return *std::max_element(v.begin(), v.end()); }

/// Per data-row: how many <rect class="op"> the SVG draws.
std::map<int, int> op_rects_per_row(const std::string& svg) {
  std::map<int, int> n;
  const std::regex rect("<rect class=\"op\" data-row=\"([0-9]+)\"");
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), rect); it != std::sregex_iterator(); ++it)
    ++n[std::stoi((*it)[1].str())];
  return n;
}

}  // namespace

// Megatron-Core's combined 1F1B: phase 0 is F(0), phase i is B(i-1) with F(i), the last
// is B(m-1) (reference/megatron-core-combined-1f1b-api.txt).
TEST(ScheduleV, CombinedOneFOneBPairsEachForwardWithAnEarlierBackward) {
  EXPECT_EQ(order_text(make_schedule(schedule_kind::combined_1f1b, 1, 4), 0), "F0 F1&B0 F2&B1 F3&B2 B3");
  // With stages: interleaved-1f1b (p = 2, v = 2, m = 4) with one more warm-up forward:
  // rank 0 warms up with (p - 1) 2 + (v - 1) p + 1 = 5 forwards, then pairs.
  const auto s = make_schedule(schedule_kind::combined_1f1b, 2, 4, 2);
  EXPECT_EQ(order_text(s, 0), "F0.0 F1.0 F0.1 F1.1 F2.0 F3.0&B0.1 F2.1&B1.1 F3.1&B0.0 B1.0 B2.1 B3.1 B2.0 B3.0");
  EXPECT_EQ(order_text(s, 1), "F0.0 F1.0 F0.1 F1.1&B0.1 F2.0&B1.1 F3.0&B0.0 F2.1&B1.0 F3.1&B2.1 B3.1 B2.0 B3.0");
  EXPECT_EQ(parse_schedule_kind("combined-1f1b"), schedule_kind::combined_1f1b);
  // One chunk with stages is refused, as Megatron-Core refuses it.
  try {
    make_schedule(schedule_kind::combined_1f1b, 2, 4, 1);
    FAIL() << "combined-1f1b with 2 stages and 1 chunk was accepted";
  } catch (const schedule_error& e) {
    EXPECT_NE(std::string(e.what()).find("at least 2 virtual chunks"), std::string::npos) << e.what();
  }
}

// ZB-V by its rule (schedule.cpp), p = 2, m = 4: stage r warms up with 2 (p - r) - 1
// forwards of chunk 0, r times F1 F0, p - r times F1 B1 W1; then F0 B0 W0 F1 B1 W1 rounds;
// cool-down r times B0 B1, p - r times B0 W0, then the W's left (chunk 1's first).
TEST(ScheduleV, ZbvOrderOfTwoStagesFourMicrobatches) {
  const auto s = make_schedule(schedule_kind::zbv, 2, 4);
  EXPECT_EQ(s.chunks, 2);
  EXPECT_EQ(order_text(s, 0),
            "F0.0 F1.0 F2.0 F0.1 B0.1 W0.1 F1.1 B1.1 W1.1 F3.0 B0.0 W0.0 F2.1 B2.1 W2.1 B1.0 W1.0 F3.1 B3.1 W3.1 "
            "B2.0 W2.0 B3.0 W3.0");
  EXPECT_EQ(order_text(s, 1),
            "F0.0 F0.1 F1.0 F1.1 B0.1 W0.1 F2.0 B0.0 W0.0 F2.1 B1.1 W1.1 F3.0 B1.0 W1.0 F3.1 B2.1 W2.1 B2.0 B3.1 "
            "B3.0 W2.0 W3.1 W3.0");
  // V placement: stage 0 holds the first and the last virtual stage.
  EXPECT_EQ(s.virtual_stage(0, 0), 0);
  EXPECT_EQ(s.virtual_stage(0, 1), 3);
  EXPECT_EQ(s.virtual_stage(1, 1), 2);
  EXPECT_EQ(s.place(2), (std::pair<int, int>{1, 1}));
  for (const auto& op : s.ranks[0])
    if (op.kind == op_kind::backward) EXPECT_TRUE(op.split);
}

// DualPipeV written out from the reference's eight steps (reference/dualpipe-dualpipev.py.txt,
// DualPipeV.step) for 2 ranks and 4 micro-batches.
TEST(ScheduleV, DualPipeVOrderEqualsTheReferencesSteps) {
  const auto s = make_schedule(schedule_kind::dualpipev, 2, 4);
  // rank 0: step 1: 2 x F0; 2: F0 F1; 3: B1 (split) W F1; 4: F0&B1 F1&B0; 5: B1 F1&B0;
  // 6: B1 B0 (even rank: split from its B0 on); 7: W B0 (split); 8: W.
  EXPECT_EQ(order_text(s, 0), "F0.0 F1.0 F2.0 F0.1 B0.1 W0.1 F1.1 F3.0&B1.1 F2.1&B0.0 B2.1 F3.1&B1.0 B3.1 B2.0 "
                              "W2.0 B3.0 W3.0");
  // rank 1 (the last): step 2: 2 x F0 F1; 4: F0 alone, B1, F1&B0, then F0&B1 F1&B0;
  // 6: B1 B0, then split (odd rank: from its B1 on) B1 B0; 8: 2 x W.
  EXPECT_EQ(order_text(s, 1),
            "F0.0 F0.1 F1.0 F1.1 F2.0 B0.1 F2.1&B0.0 F3.0&B1.1 F3.1&B1.0 B2.1 B2.0 B3.1 B3.0 W3.1 W3.0");
  const auto& r0 = s.ranks[0];
  EXPECT_TRUE(r0[4].split);    // B0.1 of step 3
  EXPECT_FALSE(r0[8].split);   // B1.1 of a pair: whole
  EXPECT_FALSE(r0[14].split);  // B3.1 of step 6 on an even rank
  EXPECT_TRUE(r0[15].split);   // B2.0
}

TEST(ScheduleV, EveryLegalScheduleOfTheNewKindsValidates) {
  for (int p = 1; p <= 8; ++p)
    for (int m = 1; m <= 24; ++m) {
      if (m >= 2 * p - 1) EXPECT_EQ(validate(make_schedule(schedule_kind::zbv, p, m)), "") << p << " " << m;
      if (m >= 2 * p) EXPECT_EQ(validate(make_schedule(schedule_kind::dualpipev, p, m)), "") << p << " " << m;
      if (m % p != 0) continue;
      for (int v : {1, 2, 3})
        if (p == 1 || v > 1)
          EXPECT_EQ(validate(make_schedule(schedule_kind::combined_1f1b, p, m, v)), "") << p << " " << m << " " << v;
    }
}

TEST(ScheduleV, BadLayoutsOfTheNewKindsSaySo) {
  auto message = [](auto make) -> std::string {
    try {
      make();
    } catch (const schedule_error& e) {
      return e.what();
    }
    return "accepted";
  };
  EXPECT_NE(message([] { make_schedule(schedule_kind::dualpipev, 4, 7); }).find("at least 2p = 8 micro-batches"),
            std::string::npos);
  EXPECT_NE(message([] { make_schedule(schedule_kind::zbv, 4, 6); }).find("at least 2p - 1 = 7"), std::string::npos);
  EXPECT_NE(message([] { make_schedule(schedule_kind::dualpipev, 2, 4, 3); }).find("set chunks = 2"),
            std::string::npos);
  EXPECT_NE(message([] { parse_schedule_kind("dualpipe"); }).find("dualpipev"), std::string::npos);
  // The validator: a W for a backward that was not split, a pair of two forwards.
  auto stray = make_schedule(schedule_kind::dualpipev, 2, 4);
  stray.ranks[0][8].split = true;  // B1.1 of the first pair now leaves its W, which never runs
  EXPECT_NE(validate(stray).find("never runs W1.1"), std::string::npos) << validate(stray);
  auto unsplit = make_schedule(schedule_kind::zbv, 2, 4);
  unsplit.ranks[0][4].split = false;  // B0.1 computes its W, but W0.1 still follows
  EXPECT_NE(validate(unsplit).find("was not split"), std::string::npos) << validate(unsplit);
  auto two_forwards = make_schedule(schedule_kind::combined_1f1b, 1, 4);
  two_forwards.ranks[0][0].paired = true;  // F0&F1
  EXPECT_NE(validate(two_forwards).find("a pair is one forward and one backward"), std::string::npos);
}

// The DualPipe README's table: DualPipeV idles (PP/2 - 1)(F&B + B - 3W) per rank, PP = 2p
// stages, B the whole backward, F&B an overlapped pair. Its drawings take a forward as
// long as the backward's input part (F = B - W); then the ranks with the most pairs (the
// last two) idle exactly that, and, with pairs that save nothing (F&B = F + B), every
// rank does. The others pair fewer ops, so a pair's saving shortens their idle less.
TEST(ScheduleV, DualPipeVIdleTimeEqualsTheReadmeTable) {
  const double cases[][4] = {{1, 2, 1, 3}, {1, 2, 1, 2.5}, {1, 2, 1, 2}, {1.5, 2, 0.5, 3.5}, {1.5, 2, 0.5, 2.6},
                             {2, 3, 1, 4}, {1, 1.5, 0.5, 2}};
  for (const auto& c : cases)
    for (int p = 2; p <= 8; ++p)
      for (int n : {2 * p, 2 * p + 3, 4 * p}) {
        const double f = c[0], b = c[1], w = c[2], fb = c[3];
        const auto sim = simulate(make_schedule(schedule_kind::dualpipev, p, n), costs(f, b, w, fb));
        const double table = (p - 1) * (fb + b - 3 * w);
        const std::string at = "F=" + std::to_string(f) + " B=" + std::to_string(b) + " W=" + std::to_string(w) +
                               " F&B=" + std::to_string(fb) + " p=" + std::to_string(p) + " n=" + std::to_string(n);
        EXPECT_NEAR(*std::max_element(sim.idle.begin(), sim.idle.end()), table, 1e-9) << at;
        EXPECT_NEAR(sim.idle[p - 1], table, 1e-9) << at;
        if (fb == f + b)
          for (int r = 0; r < p; ++r) EXPECT_NEAR(sim.idle[r], table, 1e-9) << at << " rank " << r;
        // Activation memory: PP + 1 chunk activations at most (the table's PP + 1).
        EXPECT_LE(most(sim.peak_activations), 2 * p + 1) << at;
      }
}

// ZB-V against ZB-H1 and interleaved-1f1b with F = B = W (the paper's comparison): ZB-V's
// stages idle only for the first forward's way down the V (p - 1 ops), at 1f1b's peak
// memory (2p chunk activations = p whole-stage ones); ZB-H1 at that memory and
// interleaved-1f1b (more memory) take longer.
TEST(ScheduleV, ZbvBeatsZbH1AndInterleavedAtTheSameMemory) {
  for (int p = 2; p <= 8; ++p)
    for (int m : {2 * p, 3 * p, 4 * p}) {
      const auto zbv = simulate(make_schedule(schedule_kind::zbv, p, m), costs(1, 2, 1));
      const auto zbh1 = simulate(make_schedule(schedule_kind::zero_bubble, p, m), costs(2, 4, 2));  // whole stages
      const auto inter = simulate(make_schedule(schedule_kind::interleaved, p, m, 2), costs(1, 2, 1));
      const std::string at = "p=" + std::to_string(p) + " m=" + std::to_string(m);
      EXPECT_DOUBLE_EQ(zbv.makespan, 6.0 * m + (p - 1)) << at;
      for (int r = 0; r < p; ++r) EXPECT_DOUBLE_EQ(zbv.idle[r], p - 1) << at;
      EXPECT_EQ(most(zbv.peak_activations), 2 * p) << at;
      EXPECT_EQ(2 * most(zbh1.peak_activations), 2 * p) << at;
      EXPECT_GE(most(inter.peak_activations), 2 * p) << at;
      EXPECT_LT(zbv.makespan, zbh1.makespan) << at;
      EXPECT_LT(zbv.makespan, inter.makespan) << at;
    }
}

// The all-to-all: outside a pair an op waits for its own; in combined-1f1b's pairs each
// hides behind the other's compute, so combined-1f1b beats interleaved-1f1b once the
// all-to-all costs something, and the pair costs the longer of compute and all-to-alls.
TEST(ScheduleV, CombinedOneFOneBHidesTheAllToAll) {
  for (int p : {1, 2, 4}) {
    const int v = p == 1 ? 1 : 2, m = 4 * p;
    const auto inter_kind = p == 1 ? schedule_kind::one_f_one_b : schedule_kind::interleaved;
    for (double a : {0.25, 0.5, 1.0}) {
      const auto combined = simulate(make_schedule(schedule_kind::combined_1f1b, p, m, v), costs(1, 2, 0, -1, a));
      const auto inter = simulate(make_schedule(inter_kind, p, m, v), costs(1, 2, 0, -1, a));
      EXPECT_LT(combined.makespan, inter.makespan) << p << " " << a;
    }
    // Without an all-to-all, pairing gains nothing.
    const auto plain = simulate(make_schedule(schedule_kind::combined_1f1b, p, m, v), costs(1, 2, 0));
    EXPECT_GE(plain.makespan, simulate(make_schedule(inter_kind, p, m, v), costs(1, 2, 0)).makespan);
  }
  // One stage: m pairs-or-ops in a row, each pair max(F + B, 2a).
  const auto one = simulate(make_schedule(schedule_kind::combined_1f1b, 1, 4), costs(1, 2, 0, -1, 2.0));
  EXPECT_DOUBLE_EQ(one.makespan, (1 + 2) + 3 * 4.0 + (2 + 2));
}

TEST(ScheduleV, TheDrawingHasOneBlockPerOp) {
  for (auto kind : {schedule_kind::dualpipev, schedule_kind::zbv, schedule_kind::combined_1f1b,
                    schedule_kind::one_f_one_b}) {
    const auto s = make_schedule(kind, 4, 8, kind == schedule_kind::combined_1f1b ? 2 : 0);
    const auto svg = to_svg(timeline_of(s, costs(1, 2, -1, -1, 0.25)));
    const auto rects = op_rects_per_row(svg);
    ASSERT_EQ(rects.size(), 4u) << to_string(kind);
    for (int r = 0; r < 4; ++r) EXPECT_EQ(rects.at(r), int(s.ranks[r].size())) << to_string(kind) << " " << r;
    int pairs = 0;
    for (const auto& ops : s.ranks)
      for (const auto& op : ops) pairs += op.paired;
    std::size_t framed = 0;
    for (auto at = svg.find("stroke=\"#000\""); at != std::string::npos; at = svg.find("stroke=\"#000\"", at + 1))
      ++framed;
    EXPECT_EQ(framed, std::size_t(2 * pairs)) << to_string(kind);  // both ops of each pair framed
    if (kind == schedule_kind::dualpipev) EXPECT_GT(pairs, 0);
  }
}

// The same drawing from a trace the runtime's writer wrote: one step, one replica.
TEST(ScheduleV, TheTraceDrawingHasOneBlockPerRecordedOp) {
  const auto s = make_schedule(schedule_kind::one_f_one_b, 2, 3);
  std::vector<trace_event> events;
  for (std::int64_t step : {1, 2})
    for (int replica : {0, 1})
      for (int r = 0; r < 2; ++r) {
        double t = 100.0 * r;
        for (const auto& op : s.ranks[r]) {
          events.push_back({op_letter(op.kind), replica, r, op.mb, op.chunk, step, t, t + 50});
          t += 60;
        }
      }
  events.push_back({"send activation", 0, 0, 0, 0, 2, 1.0, 2.0, 64});  // not an op
  const auto path = std::filesystem::temp_directory_path() / "troupe_trace_svg_test.json";
  write_chrome_trace(path.string(), events, 2, 2);
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  std::filesystem::remove(path);
  const auto t = timeline_of_trace(text.str());  // the last step, replica 0
  EXPECT_EQ(t.rows, 2);
  EXPECT_EQ(t.blocks.size(), s.ranks[0].size() + s.ranks[1].size());
  const auto rects = op_rects_per_row(to_svg(t));
  EXPECT_EQ(rects.at(0), int(s.ranks[0].size()));
  EXPECT_EQ(rects.at(1), int(s.ranks[1].size()));
  EXPECT_THROW(timeline_of_trace(text.str(), 7), std::runtime_error);  // no such step
  EXPECT_THROW(timeline_of_trace("{not json"), std::runtime_error);
}

}  // namespace troupe
