// A node process killed mid-run is noticed within seconds.
#include <gtest/gtest.h>

#include <csignal>
#include <filesystem>
#include <fstream>

#include "actors/runtime.hpp"
#include "compute/checkpoint/checkpoint.hpp"
#include "node_jobs.hpp"

using namespace troupe;
using test::free_port;
using test::start;
using test::job;

// A node killed mid-run: the coordinator notices, aborts the step and ends the job with
// an error naming the node, within seconds (no hang).
TEST(MultiProcessFaults, KilledNodeIsNoticedWithinSeconds) {
  test::temp_dir dir;
  auto group = start({2, {"--pipeline", "2", "--data-parallel", "2", "--steps", "2000", "--eval-interval", "0"}}, dir,
                     free_port());
  ASSERT_TRUE(group.wait_for_log(0, [](const std::string& s) { return s.find("3/2000 |") != std::string::npos; },
                                 std::chrono::seconds(120)))
      << group.log(0);
  group.signal(1, SIGKILL);
  const auto killed_at = std::chrono::steady_clock::now();
  const bool ended = group.wait_for_log(
      0, [](const std::string& s) { return s.find("troupe: error") != std::string::npos; }, std::chrono::seconds(30));
  const auto took = std::chrono::duration<double>(std::chrono::steady_clock::now() - killed_at).count();
  const auto results = group.wait(std::chrono::seconds(30));
  ASSERT_TRUE(ended) << results[0].output;
  EXPECT_LT(took, 20.0);
  EXPECT_EQ(results[0].status, troupe::exit_recoverable) << results[0].output;  // the launcher restarts it
  EXPECT_NE(results[0].output.find("node 1 is gone"), std::string::npos) << results[0].output;
}
