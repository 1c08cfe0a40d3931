// Joining a job: a node that fails before it is ready ends the job with its reason; a wrong
// token or protocol version is refused.
#include <gtest/gtest.h>

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

// A node that joined and then fails before it is ready (here a bad TROUPE_NCCL value in
// node 1's environment only, refused with exit 2 after the join) tells node 0, which
// ends the job with node 1's reason (status 1) instead of waiting out its join timeout
// (60 s, longer than this test waits: a node 0 that waited fails the reason check).
TEST(MultiProcessJoin, ANodeThatFailsBeforeItIsReadyEndsTheJob) {
  test::temp_dir dir;
  job j{2, {"--pipeline", "2", "--steps", "2"}};
  j.extra_env = {"TROUPE_NCCL=maybe"};
  auto group = start(j, dir, free_port());
  const auto results = group.wait(std::chrono::seconds(45));
  EXPECT_EQ(results[1].status, 2) << results[1].output;
  EXPECT_NE(results[1].output.find("TROUPE_NCCL=maybe: expected 1 or 0"), std::string::npos) << results[1].output;
  EXPECT_EQ(results[0].status, 1) << results[0].output;
  EXPECT_TRUE(std::regex_search(results[0].output,
                                std::regex("node 1 on [^ ]+ cannot run this job: TROUPE_NCCL=maybe: expected 1 or 0")))
      << results[0].output;
  EXPECT_EQ(results[0].output.find("1/2 |"), std::string::npos) << "the job started without node 1";
}

// A node with another token, or another protocol version, is refused (and the refusal is
// logged by the coordinator); the job does not start with it.
TEST(MultiProcessJoin, WrongTokenOrVersionIsRefused) {
  for (const bool version : {false, true}) {
    test::temp_dir dir;
    job j{2, {"--data-parallel", "2", "--steps", "2"}};
    if (version)
      j.extra_env = {"TROUPE_PROTOCOL_VERSION=99"};
    else
      j.tokens = {"right-token", "wrong-token"};
    auto group = start(j, dir, free_port());
    ASSERT_TRUE(group.wait_for_log(0, [](const std::string& s) { return s.find("refused") != std::string::npos; },
                                   std::chrono::seconds(60)))
        << group.log(0);
    // Node 0 keeps waiting for a rightful node 1 (until its join timeout): killed here.
    const auto results = group.wait(std::chrono::seconds(5));
    EXPECT_EQ(results[1].status, 3) << results[1].output;
    EXPECT_NE(results[1].output.find(version ? "protocol version 99" : "wrong job token"), std::string::npos)
        << results[1].output;
    EXPECT_NE(results[0].output.find(version ? "protocol version 99" : "wrong job token"), std::string::npos)
        << results[0].output;
    EXPECT_EQ(results[0].output.find("1/2 |"), std::string::npos) << "the job started without node 1";
  }
}
