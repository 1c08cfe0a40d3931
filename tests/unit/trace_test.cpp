// The trace's measures (bubble, gradient-reduction tail) and the job clock that puts
// every node's events on node 0's timeline (offset and drift from probes).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

#include "actors/trace.hpp"

namespace troupe {

// The metrics' measured bubble and gradient-reduction tail, on made-up events (us).
TEST(Trace, MeasureStepGivesTheBubbleAndTheReduceTail) {
  const std::vector<trace_event> events{
      // replica 0: window 0-60, each stage busy 30
      {"F", 0, 0, 0, 0, 0, 0, 10}, {"F", 0, 1, 0, 0, 0, 10, 20}, {"B", 0, 1, 0, 0, 0, 20, 40},
      {"B", 0, 0, 0, 0, 0, 40, 60},
      {"reduce-scatter", 0, 1, 0, 0, 0, 40, 55},  // stage 1's: over before the replica's last op
      {"reduce-scatter", 0, 0, 0, 0, 0, 60, 70},  // stage 0's: 10 us after it
      // replica 1: window 0-30, stage 0 busy 30, stage 1 idle; its reduction ends first
      {"F", 1, 0, 0, 0, 0, 0, 10}, {"B", 1, 0, 0, 0, 0, 10, 30}, {"reduce-scatter", 1, 0, 0, 0, 0, 25, 28},
      {"send activation", 0, 0, 0, 0, 0, 10, 200}};  // not compute: no part of either
  const auto t = measure_step(events, 2, 2);
  EXPECT_NEAR(t.reduce_tail_s, 10e-6, 1e-12);
  EXPECT_NEAR(t.bubble, 1.0 - 90.0 / 180.0, 1e-12);
  EXPECT_NEAR(t.window_s, 60e-6, 1e-12);
  EXPECT_NEAR(t.idle_s.at(3), 30e-6, 1e-12);
  // An overlapped pair's forward and backward (combined-1f1b with experts) computing at
  // once: the track is busy for the union of their spans, not their sum.
  const std::vector<trace_event> pair{{"F", 0, 0, 0, 0, 0, 0, 10}, {"F", 0, 0, 1, 0, 0, 10, 30},
                                      {"B", 0, 0, 0, 0, 0, 12, 25}, {"B", 0, 0, 1, 0, 0, 40, 50}};
  const auto p = measure_step(pair, 1, 1);
  EXPECT_NEAR(p.busy_s.at(0), 40e-6, 1e-12);
  EXPECT_NEAR(p.bubble, 1.0 - 40.0 / 50.0, 1e-12);
}

// Cristian's method: the offset from the shortest round trip, read at its middle.
TEST(Trace, ClockOffsetComesFromTheShortestRoundTrip) {
  const std::int64_t ahead = 5'000'000'000;  // node 0's clock is 5 s ahead of this node's
  // (sent, node 0's reading, received), this node's clock; the second is the quickest
  // (400 ns, read 100 ns after halfway: the answer's way was the shorter).
  const std::vector<clock_sample> samples{{1000, 1500 + ahead, 3000},
                                          {10000, 10300 + ahead, 10400},
                                          {20000, 20100 + ahead, 21000}};
  std::int64_t round_trip = 0;
  EXPECT_EQ(clock_offset_ns(samples, &round_trip), ahead + 100);
  EXPECT_EQ(round_trip, 400);
  EXPECT_EQ(clock_offset_ns({{0, -7, 0}}), -7);
  EXPECT_THROW(clock_offset_ns({}), std::invalid_argument);
}

// A clock that drifts: node 0's clock = local + offset(local), offset a line the probes
// fit. Probes of an exact line give that line back (offset between and past them, rate); a
// probe with a long round trip (an answer held up 20 ms, its offset 10 ms off) hardly
// moves it; the last 32 probes count; an absurd slope is bounded at 5 %.
TEST(Trace, JobClockFollowsADriftingClock) {
  const std::int64_t s = 1'000'000'000;  // one second, in ns
  // This node's clock runs 200 ppm fast: node 0's = 3 s + local / 1.0002.
  auto node0 = [&](std::int64_t local) { return 3 * s + std::int64_t(double(local) / 1.0002); };
  auto probe = [&](std::int64_t at, std::int64_t round_trip, std::int64_t error = 0) {
    std::vector<clock_sample> round{{at, node0(at + round_trip / 2) + error, at + round_trip}};
    round.push_back({at + 5 * s / 1000, node0(at + 5 * s / 1000 + 4 * round_trip) , at + 5 * s / 1000 + 8 * round_trip});
    return round;  // the second sample's round trip is 8 times longer: not the one used
  };
  job_clock none(0);
  EXPECT_EQ(none.offset_ns(123 * s), 0);
  EXPECT_EQ(none.probes(), 0);
  EXPECT_EQ(none.drift_ppm(), 0);

  job_clock clock(0);
  std::int64_t round_trip = 0;
  EXPECT_EQ(clock.add_probe(probe(100 * s, 200'000), &round_trip), node0(100 * s + 100'000) - (100 * s + 100'000));
  EXPECT_EQ(round_trip, 200'000);
  EXPECT_EQ(clock.drift_ppm(), 0);  // one probe: the offset alone
  EXPECT_EQ(clock.offset_ns(150 * s), node0(100 * s + 100'000) - (100 * s + 100'000));
  for (int i = 1; i <= 5; ++i) clock.add_probe(probe((100 + 10 * i) * s, 200'000));
  EXPECT_EQ(clock.probes(), 6);
  EXPECT_NEAR(clock.probed_span_s(), 50.0, 1e-9);
  EXPECT_NEAR(clock.drift_ppm(), 200.0, 0.01);
  for (const std::int64_t t : {125 * s, 150 * s, 400 * s})  // between the probes, at the last, far past it
    EXPECT_NEAR(double(clock.offset_ns(t)), double(node0(t) - t), 10.0) << t;  // the probes truncated to 1 ns

  clock.add_probe(probe(160 * s, 20'000'000, 10'000'000));  // answered 20 ms late, 10 ms off
  EXPECT_NEAR(double(clock.offset_ns(160 * s)), double(node0(160 * s) - 160 * s), 1000.0);
  EXPECT_NEAR(clock.drift_ppm(), 200.0, 1.0);

  // 40 more probes of a clock that now runs 100 ppm slow from 200 s on: only the last 32 count.
  auto later = [&](std::int64_t local) { return node0(200 * s) + std::int64_t(double(local - 200 * s) / 0.9999); };
  for (int i = 0; i < 40; ++i) {
    const std::int64_t at = 200 * s + i * 10 * s;
    clock.add_probe({{at, later(at + 100'000), at + 200'000}});
  }
  EXPECT_EQ(clock.probes(), 47);
  EXPECT_NEAR(clock.drift_ppm(), -100.0, 0.01);
  EXPECT_NEAR(double(clock.offset_ns(700 * s)), double(later(700 * s) - 700 * s), 2.0);

  job_clock wild(0);  // two probes 1 ms apart whose offsets differ by 1 ms
  wild.add_probe({{0, 0, 2000}});
  wild.add_probe({{1'000'000, 2'000'000, 1'002'000}});
  EXPECT_NEAR(wild.drift_ppm(), -0.05 / 1.05 * 1e6, 1e-6);
}

// The timeline of a process: its steady clock from the epoch, in microseconds; a
// pretended clock (tests) reads ahead and runs fast, and the probes take both out.
TEST(Trace, JobClockNowIsOnTheEpochsTimeline) {
  const auto start = steady_clock_ns();
  job_clock plain(start - 2'000'000);  // epoch 2 ms ago
  const double now = plain.now_us();
  EXPECT_GE(now, 2000.0);
  EXPECT_LT(now, 2000.0 + double(steady_clock_ns() - start) * 1e-3 + 1.0);

  job_clock pretend(start, 5'000'000'000, 50'000);  // 5 s ahead, 5 % fast
  EXPECT_GE(pretend.local_ns() - steady_clock_ns(), 4'999'000'000);
  std::vector<clock_sample> round;
  for (int i = 0; i < 8; ++i) {
    clock_sample c;
    c.sent_ns = pretend.local_ns();
    c.remote_ns = steady_clock_ns();  // node 0's clock is this process's real one
    c.received_ns = pretend.local_ns();
    round.push_back(c);
  }
  pretend.add_probe(round);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  round.clear();
  for (int i = 0; i < 8; ++i) {
    clock_sample c;
    c.sent_ns = pretend.local_ns();
    c.remote_ns = steady_clock_ns();
    c.received_ns = pretend.local_ns();
    round.push_back(c);
  }
  pretend.add_probe(round);
  EXPECT_NEAR(pretend.drift_ppm(), 50'000.0, 2'000.0);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const double real_us = double(steady_clock_ns() - start) * 1e-3;
  EXPECT_NEAR(pretend.now_us(), real_us, 200.0);  // uncorrected: 5 s + 2.5 ms off
}

}  // namespace troupe
