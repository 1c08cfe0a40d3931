// The wait-for graph's root (actors/wait_graph.hpp): a lost message, an actor that does
// not answer, one that waits for nothing while others wait on it, a deadlock, a group
// collective a member never joined or that every member is stuck in.
#include <gtest/gtest.h>

#include <future>
#include <memory>
#include <thread>

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

// Its node answered for it and its thread is in no op (the coordinator's words): said as
// they are, without the guess about a long op.
TEST(WaitGraph, AnActorFrozenOutsideAnOpIsSaidToBe) {
  auto coordinator = waiting("coordinator", 0, "4 loss reports", "stage 1");
  const std::string no_op = "its node answered, but its thread is in no op: frozen or stuck in the actor's own code";
  const auto d = diagnose_waits({coordinator}, {idle("stage 1", 0, no_op)}, 2);
  EXPECT_EQ(d.root, "stage 1 (node 0) does not answer (" + no_op + ")");
}

TEST(WaitGraph, AnActorInsideALongOpIsNamedWithItsOp) {
  auto coordinator = waiting("coordinator", 0, "4 loss reports", "stage 1");
  const auto d = diagnose_waits({coordinator}, {idle("stage 1", 0, "its thread is in op F2 (mb 2, chunk 0) for 9.0 s")}, 2);
  EXPECT_EQ(d.root, "stage 1 (node 0) does not answer (its thread is in op F2 (mb 2, chunk 0) for 9.0 s: a long op, "
                    "or frozen in it)");
}

namespace {

/// `actor` inside collective `call` of a group with `members` (as a node's board says).
wait_report in_collective(std::string actor, std::string call, std::vector<std::string> members) {
  wait_report r;
  r.actor = actor;
  r.node = 0;
  r.waits_for = "all-reduce " + call;
  r.collective = call;
  for (auto& m : members)
    if (m != actor) r.from.push_back(m);
  r.state = "its thread is in op F1 (mb 1, chunk 0) for 3.0 s";
  return r;
}

}  // namespace

TEST(WaitGraph, AGroupCollectiveWaitsForTheMembersNotInTheSameCall) {
  const std::vector<std::string> group{"tp 0", "tp 1", "tp 2"};
  auto coordinator = waiting("coordinator", 0, "1 stage-done report", "tp 0");
  // tp 0 and tp 2 are in call #7; tp 1 is frozen outside any op: it is the root.
  auto d = diagnose_waits({coordinator, in_collective("tp 0", "g #7", group), in_collective("tp 2", "g #7", group)},
                          {idle("tp 1", 0, "")}, 2);
  EXPECT_EQ(d.root, "tp 1 (node 0) does not answer (its thread is blocked: a long op, or frozen)");
  EXPECT_TRUE(has_line(d, "tp 0 (node 0) waits for all-reduce g #7 from tp 1 (node 0); its thread is in op F1"))
      << "the member in the same call is not waited for";
  // tp 1 waits for an activation instead (it answered): the wait goes on to its sender.
  auto tp1 = waiting("tp 1", 0, "activation mb 1 chunk 0", "stage 0");
  d = diagnose_waits({coordinator, in_collective("tp 0", "g #7", group), in_collective("tp 2", "g #7", group), tp1},
                     {idle("stage 0", 0, "")}, 2);
  EXPECT_EQ(d.root, "stage 0 (node 0) does not answer (its thread is blocked: a long op, or frozen)");
  // Every member in call #7, and it does not finish: the call is the root, named once.
  d = diagnose_waits({coordinator, in_collective("tp 0", "g #7", group), in_collective("tp 1", "g #7", group),
                      in_collective("tp 2", "g #7", group)},
                     {}, 2);
  EXPECT_EQ(d.root, "the all-reduce g #7 was entered by every member (tp 0 (node 0), tp 1 (node 0) and tp 2 (node 0)) "
                    "and has not finished: its transport lost a transfer, or a member's device does not finish it");
  EXPECT_TRUE(has_line(d, "tp 1 (node 0) waits in the all-reduce g #7, which every member of the group has entered"));
  // Members in different calls of one group wait for each other: a deadlock (collectives
  // called in different orders).
  d = diagnose_waits({coordinator, in_collective("tp 0", "g #7", {"tp 0", "tp 1"}),
                      in_collective("tp 1", "g #8", {"tp 0", "tp 1"})},
                     {}, 2);
  EXPECT_EQ(d.root, "a deadlock: tp 0 (node 0) waits for tp 1 (node 0) waits for tp 0 (node 0)");
}

// 16,384 ranks (1,024 pipelines of 16 stages, a shard beside each stage): stage 3 of
// pipeline 5 is frozen. Its pipeline's later stages wait for its activations, the earlier
// ones for its gradients, its shards' data-parallel peers in the reduce-scatter for
// pipeline 5's shards, and the coordinator for all of them. The log names the root and
// the chain to it in a few lines; every actor's line is still there for the debug log.
TEST(WaitGraph, SixteenThousandRanksNameTheRootInAFewLines) {
  const int pipes = 1024, stages = 16, hung_pipe = 5, hung_stage = 3;
  auto stage = [](int r, int k) { return "stage " + std::to_string(k) + " of pipeline " + std::to_string(r); };
  auto shard = [](int k, int r) { return "shard " + std::to_string(k) + "." + std::to_string(r); };
  auto node = [](int r, int k) { return (r * 16 + k) / 8; };  // 8 ranks a node
  wait_report coordinator;
  coordinator.actor = "coordinator";
  coordinator.waits_for = "16 stage-done reports and 16384 shard-done reports";
  for (int k = 0; k < stages; ++k) coordinator.from.push_back(stage(hung_pipe, k));
  for (int k = 0; k < stages; ++k)
    for (int r = 0; r < pipes; ++r) coordinator.from.push_back(shard(k, r));
  std::vector<wait_report> reports{coordinator}, silent;
  for (int k = 0; k < stages; ++k) {
    if (k == hung_stage) {
      silent.push_back(idle(stage(hung_pipe, k), node(hung_pipe, k), ""));
    } else {
      const int from = k > hung_stage ? k - 1 : k + 1;
      reports.push_back(waiting(stage(hung_pipe, k), node(hung_pipe, k), k > hung_stage ? "activation mb 0 chunk 0" : "gradient mb 3 chunk 0",
                                stage(hung_pipe, from)));
    }
    for (int r = 0; r < pipes; ++r)
      reports.push_back(r == hung_pipe ? waiting(shard(k, r), node(r, k), "the step's gradients", stage(r, k))
                                       : waiting(shard(k, r), node(r, k), "the reduce-scatter", shard(k, hung_pipe)));
  }
  const auto d = diagnose_waits(reports, silent, 2);
  EXPECT_EQ(d.root, "stage 3 of pipeline 5 (node 10) does not answer (its thread is blocked: a long op, or frozen)");
  EXPECT_GT(d.all_lines.size(), std::size_t(stages * pipes));
  EXPECT_LE(d.lines.size(), brief_lines);
  EXPECT_TRUE(has_line(d, "stage 3 of pipeline 5 (node 10) did not answer"));
  EXPECT_TRUE(has_line(d, "coordinator (node 0) waits for 16 stage-done reports and 16384 shard-done reports from stage 0 of "
                          "pipeline 5 (node 10), "));
  EXPECT_TRUE(has_line(d, "and 16392 more")) << "the coordinator's line names 8 of whom it waits on";
  // The last line counts what it leaves out.
  EXPECT_NE(d.lines.back().find("more actors wait on these or on each other, 0 of them silent"), std::string::npos)
      << d.lines.back();
}

TEST(WaitGraph, NothingWaitedForSaysSo) {
  const auto d = diagnose_waits({idle("coordinator", 0, "between steps")}, {}, 2);
  EXPECT_EQ(d.root, "no actor waits for another (the step may have been about to finish)");
  EXPECT_TRUE(d.lines.empty());
}

}  // namespace troupe
