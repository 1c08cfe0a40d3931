// Nodes of another machine (a skewed or drifting steady clock) put their trace events on
// node 0's timeline.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <regex>

#include "actors/runtime.hpp"
#include "compute/checkpoint/checkpoint.hpp"
#include "node_jobs.hpp"

using namespace troupe;
using test::free_port;
using test::start;
using test::job;

// A p2 x d1 job on 2 nodes whose node 1 (stage 1) pretends another machine (`env`: its
// clock's skew and drift, TROUPE_TEST_CLOCK_*). Returns node 1's log and each tensor
// message received earlier on node 0's timeline than its send began (by more than the
// offset's measuring error): the receive is an instant on the receiver's track, the send
// a slice on the sender's (the F or B before it also holds the send, so the receiver may
// start before that op's end). Checks the run ended well and every step's bubble < 0.9.
struct clock_run {
  std::string node1_log;
  std::vector<std::string> early;  ///< "step S: stage K got <what> N us before stage J sent it"
};
clock_run run_with_another_clock(const std::vector<std::string>& env, int steps) {
  test::temp_dir dir;
  const std::string trace = dir / "trace.json", metrics = dir / "m.jsonl";
  job j{2, {"--pipeline", "2", "--data-parallel", "1", "--microbatches", "4", "--steps", std::to_string(steps),
            "--eval-interval", "0", "--threads", "1", "--trace", trace, "--metrics", metrics}};
  j.extra_env = env;
  auto group = start(j, dir, free_port());
  const auto results = group.wait(std::chrono::seconds(120));
  clock_run out;
  out.node1_log = results[1].output;
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(results[i].status, 0) << "node " << i << ":\n" << results[i].output;
    if (results[i].status != 0) return out;
  }
  EXPECT_EQ(results[0].output.find("another machine"), std::string::npos) << results[0].output;

  std::map<std::tuple<std::int64_t, int, std::string, int>, double> at;  // (step, stage, name, mb) -> ts
  const auto chrome = nlohmann::json::parse(std::ifstream(trace));
  for (const auto& e : chrome.at("traceEvents")) {
    if (e.value("cat", "") != "comm") continue;
    const auto& a = e.at("args");
    at[{a.at("step").get<std::int64_t>(), a.at("stage").get<int>(), e.at("name").get<std::string>(),
        a.at("mb").get<int>()}] = e.at("ts").get<double>();
  }
  // steps x (4 micro-batches x (activation, gradient) + each stage's tied gradient) x (send, receive)
  EXPECT_EQ(at.size(), std::size_t(20 * steps));
  const double slack_us = 2000;  // the measured offset is within half a round trip
  auto check = [&](std::int64_t step, int from, int to, const std::string& what, int mb) {
    const auto sent = at.find({step, from, "send " + what, mb}), got = at.find({step, to, "recv " + what, mb});
    if (sent == at.end() || got == at.end()) {
      ADD_FAILURE() << "step " << step << ": no send or receive of " << what << " " << mb;
      return;
    }
    if (got->second < sent->second - slack_us)
      out.early.push_back("step " + std::to_string(step) + ": stage " + std::to_string(to) + " got " + what + " " +
                          std::to_string(mb) + " " + std::to_string(sent->second - got->second) +
                          " us before stage " + std::to_string(from) + " sent it");
  };
  for (std::int64_t step = 0; step < steps; ++step) {
    check(step, 0, 1, "tied gradient", -1);
    check(step, 1, 0, "tied gradient", -1);
    for (int mb = 0; mb < 4; ++mb) {
      check(step, 0, 1, "activation", mb);
      check(step, 1, 0, "gradient", mb);
    }
  }
  std::ifstream lines(metrics);
  int measured = 0;
  for (std::string line; std::getline(lines, line);) {
    const auto m = nlohmann::json::parse(line);
    if (!m.contains("bubble")) continue;
    EXPECT_LT(m.at("bubble").get<double>(), 0.9) << line;
    ++measured;
  }
  EXPECT_EQ(measured, steps);
  return out;
}

std::string lines_of(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& l : v) s += l + "\n";
  return s;
}

// A node of "another machine" whose steady clock is 5 s ahead of node 0's measures the
// offset when it joins: its stage's ops land on node 0's timeline. Stage 1 runs on the
// skewed node, so without the offset each of its ops would show 5 s late, the gradients
// it sends received 5 s before they were sent, and the measured bubble near 1.
TEST(MultiProcessClocks, ANodeWithAnotherClockJoinsNodeZerosTimeline) {
  const auto run = run_with_another_clock({"TROUPE_TEST_CLOCK_SKEW_MS=5000"}, 3);
  std::smatch found;
  const std::regex offset_line("another machine than node 0's: its clock is ([-+0-9.]+) ms");
  ASSERT_TRUE(std::regex_search(run.node1_log, found, offset_line)) << run.node1_log;
  EXPECT_NEAR(std::stod(found[1]), -5000.0, 2.0) << found[0];
  EXPECT_TRUE(run.early.empty()) << lines_of(run.early);
}

// And whose clock also runs 0.5 % fast (5 ms per second, some hundred times a real
// crystal's drift): the probes after the join follow the drift. Node 1 reports the rate
// it fitted. With the probes off (TROUPE_CLOCK_PROBE_SECONDS=0: the offset of the join
// only) the same run shows node 1's sends later and later, and node 0 receiving
// gradients before they were sent: the check can fail.
TEST(MultiProcessClocks, ANodeWhoseClockDriftsStaysOnNodeZerosTimeline) {
  const auto run = run_with_another_clock(
      {"TROUPE_TEST_CLOCK_SKEW_MS=5000", "TROUPE_TEST_CLOCK_DRIFT_PPM=5000", "TROUPE_CLOCK_PROBE_SECONDS=0.4"}, 4);
  EXPECT_TRUE(run.early.empty()) << lines_of(run.early);
  std::smatch found;
  const std::regex rate_line("its clock ran ([-+0-9.]+) ppm against node 0's \\(([0-9]+) probes");
  ASSERT_TRUE(std::regex_search(run.node1_log, found, rate_line)) << run.node1_log;
  EXPECT_NEAR(std::stod(found[1]), 5000.0, 500.0) << found[0];
  EXPECT_GE(std::stoi(found[2]), 3) << found[0];

  const auto unprobed = run_with_another_clock(
      {"TROUPE_TEST_CLOCK_SKEW_MS=5000", "TROUPE_TEST_CLOCK_DRIFT_PPM=5000", "TROUPE_CLOCK_PROBE_SECONDS=0"}, 4);
  EXPECT_FALSE(unprobed.early.empty()) << "without probes after the join, the drift went unseen";
  EXPECT_EQ(unprobed.node1_log.find("ppm against node 0's"), std::string::npos) << unprobed.node1_log;
}
