// The coordinator's phases (named behaviors switched with become(); actors/coordinator/coordinator.hpp
// draws them): a run goes through them in order, and a failed step through rebuilding
// and wiring before it runs again, while the supervisor goes from serving to recovering
// and back (supervisor_actor.hpp). Read from the debug log of each switch.
#include <gtest/gtest.h>

#include <memory>
#include <mutex>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>

#include "actors/runtime.hpp"
#include "test_util.hpp"

namespace troupe {

namespace {

/// Runs `c` in one process with the log at debug level going to a string only; returns
/// the coordinator's phase switches as "from>to@step" (and in `supervisor`, when given,
/// the supervisor's as "node N: PHASE").
std::vector<std::string> phase_switches(const job_config& c, actor_run_result& result,
                                        std::vector<std::string>* supervisor = nullptr) {
  std::ostringstream out;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(out);
  auto capture = std::make_shared<spdlog::logger>("phases", sink);
  capture->set_level(spdlog::level::debug);
  const auto previous = spdlog::default_logger();
  spdlog::set_default_logger(capture);
  actor_run_options quiet;
  quiet.quiet = true;
  result = run_actor_training(c, quiet);
  spdlog::set_default_logger(previous);
  std::vector<std::string> switches;
  const std::regex line(R"(coordinator: ([a-z ]+) -> ([a-z ]+) \(step (\d+)\))");
  const std::regex supervisor_line(R"(supervisor of (node \d+: (serving|recovering \(round \d+, step \d+\))))");
  std::istringstream in(out.str());
  for (std::string l; std::getline(in, l);) {
    std::smatch m;
    if (std::regex_search(l, m, line)) switches.push_back(m[1].str() + ">" + m[2].str() + "@" + m[3].str());
    if (supervisor && std::regex_search(l, m, supervisor_line)) supervisor->push_back(m[1].str());
  }
  return switches;
}

job_config two_stage_job() {
  auto c = test::gpt_config(6);
  c.pipeline = 2;
  c.data_parallel = 2;
  c.microbatches = 4;
  c.eval_interval = 0;  // the last step's evaluation only
  c.eval_mode = "pipeline";
  return c;
}

}  // namespace

TEST(CoordinatorPhases, ARunGoesThroughItsPhasesInOrder) {
  auto c = two_stage_job();
  c.steps = 2;
  c.eval_interval = 1;
  actor_run_result r;
  const auto got = phase_switches(c, r);
  ASSERT_EQ(r.exit_code, 0) << r.error;
  const std::vector<std::string> want{
      "idle>wiring@1",
      "wiring>stepping@1",
      "stepping>between steps@1",
      "between steps>evaluating@1",
      "evaluating>between steps@1",
      "between steps>stepping@2",
      "stepping>between steps@2",
      "between steps>evaluating@2",
      "evaluating>between steps@2",
      "between steps>finished@2"};
  EXPECT_EQ(got, want);
}

TEST(CoordinatorPhases, AFailedStepIsRebuiltAndWiredBeforeItRunsAgain) {
  auto c = two_stage_job();
  c.steps = 3;
  c.max_step_retries = 1;
  c.step_timeout = 30;
  c.set("faults.throw_at", "0:1:1", "test");  // replica 0, stage 1 throws in step 2
  actor_run_result r;
  std::vector<std::string> supervisor;
  const auto got = phase_switches(c, r, &supervisor);
  ASSERT_EQ(r.exit_code, 0) << r.error;
  // The supervisor serves from its start; the retry of step 2 is its first recovery.
  EXPECT_EQ(supervisor, (std::vector<std::string>{"node 0: recovering (round 1, step 2)", "node 0: serving"}));
  const std::vector<std::string> want{
      "idle>wiring@1",
      "wiring>stepping@1",
      "stepping>between steps@1",
      "between steps>stepping@2",
      "stepping>rebuilding@2",  // replica 0's stage 1 threw
      "rebuilding>wiring@2",
      "wiring>stepping@2",  // the same step again
      "stepping>between steps@2",
      "between steps>stepping@3",
      "stepping>between steps@3",
      "between steps>evaluating@3",
      "evaluating>between steps@3",
      "between steps>finished@3"};
  EXPECT_EQ(got, want);
}

TEST(CoordinatorPhases, AFailureAfterTheLastRetryEndsTheRun) {
  auto c = two_stage_job();
  c.steps = 2;
  c.max_step_retries = 0;
  c.set("faults.throw_at", "0:1:0", "test");
  actor_run_result r;
  const auto got = phase_switches(c, r);
  EXPECT_EQ(r.exit_code, exit_recoverable) << r.error;
  const std::vector<std::string> want{"idle>wiring@1", "wiring>stepping@1", "stepping>finished@1"};
  EXPECT_EQ(got, want);
}

}  // namespace troupe
