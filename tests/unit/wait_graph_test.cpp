// The wait-for graph's root (actors/wait_graph.hpp): a lost message, an actor that does
// not answer, one that waits for nothing while others wait on it, a deadlock.
#include <gtest/gtest.h>

#include "actors/wait_graph.hpp"

namespace troupe {

namespace {

wait_report waiting(std::string actor, int node, std::string what, std::string from, std::string sender_key = "") {
  wait_report r;
  r.actor = std::move(actor);
  r.node = node;
  r.waits_for = std::move(what);
  r.from = {std::move(from)};
  if (!sender_key.empty()) r.keys = {sender_key};
  return r;
}

wait_report idle(std::string actor, int node, std::string state) {
  wait_report r;
  r.actor = std::move(actor);
  r.node = node;
  r.state = std::move(state);
  return r;
}

bool has_line(const wait_diagnosis& d, const std::string& text) {
  for (const auto& l : d.lines)
    if (l.find(text) != std::string::npos) return true;
  return false;
}

}  // namespace

TEST(WaitGraph, AMessageSentAndNeverReceivedIsTheRoot) {
  const auto key = message_key("activation mb 3 chunk 0", "stage 0", "stage 1");
  auto coordinator = waiting("coordinator", 0, "1 loss report", "stage 1");
  auto s1 = waiting("stage 1", 1, "activation mb 3 chunk 0", "stage 0", key);
  s1.state = "ran 5 of 16 ops (last B2)";
  auto s0 = waiting("stage 0", 0, "gradient mb 3 chunk 0", "stage 1", message_key("gradient mb 3 chunk 0", "stage 1", "stage 0"));
  s0.sent = {key};
  const auto d = diagnose_waits({coordinator, s1, s0}, {}, 2);
  EXPECT_EQ(d.root, key + " was sent and never received: a lost message");
  // Asked while the job runs (a status request): it may still be on its way.
  EXPECT_EQ(diagnose_waits({coordinator, s1, s0}, {}, 2, /*settled=*/false).root,
            key + " was sent and not received yet (in flight, or lost)");
  EXPECT_TRUE(has_line(d, "stage 1 (node 1) waits for activation mb 3 chunk 0 from stage 0 (node 0); ran 5 of 16 ops (last B2)"));
  // Without the send, the two stages wait for each other: a deadlock.
  s0.sent.clear();
  const auto cycle = diagnose_waits({coordinator, s1, s0}, {}, 2);
  EXPECT_EQ(cycle.root, "a deadlock: stage 1 (node 1) waits for stage 0 (node 0) waits for stage 1 (node 1)");
}

TEST(WaitGraph, TheActorEveryoneWaitsOnAndThatWaitsForNothingIsTheRoot) {
  wait_report coordinator = waiting("coordinator", 0, "2 gradient-norm partials", "shard 0");
  coordinator.from.push_back("shard 1");
  auto shard1 = waiting("shard 1", 1, "the reduce-scatter of its gradients", "shard 0");
  auto shard0 = idle("shard 0", 0, "holds every gradient bucket and started no reduce-scatter");
  auto loader = idle("loader", 0, "sent 8 of 8 micro-batches");
  const auto d = diagnose_waits({coordinator, shard1, shard0, loader}, {}, 2);
  EXPECT_EQ(d.root, "shard 0 (node 0) waits for nothing (holds every gradient bucket and started no reduce-scatter)");
  EXPECT_TRUE(has_line(d, "shard 0 (node 0) waits for nothing"));
  EXPECT_FALSE(has_line(d, "loader")) << "an actor nobody waits on and that waits for nothing is left out";
}

TEST(WaitGraph, AnActorThatDoesNotAnswerIsTheRoot) {
  auto coordinator = waiting("coordinator", 0, "4 loss reports", "stage 1");
  auto s0 = waiting("stage 0", 0, "gradient mb 0 chunk 0", "stage 1");
  const auto d = diagnose_waits({coordinator, s0}, {idle("stage 1", 0, "")}, 2);
  EXPECT_EQ(d.root, "stage 1 (node 0) does not answer (its thread is blocked: a long op, or frozen)");
  EXPECT_TRUE(has_line(d, "stage 1 (node 0) did not answer within 2 s"));
}

TEST(WaitGraph, NothingWaitedForSaysSo) {
  const auto d = diagnose_waits({idle("coordinator", 0, "between steps")}, {}, 2);
  EXPECT_EQ(d.root, "no actor waits for another (the step may have been about to finish)");
  EXPECT_TRUE(d.lines.empty());
}

}  // namespace troupe
