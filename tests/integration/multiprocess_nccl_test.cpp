// Where node processes run their groups over NCCL: the refusals, the links between nodes,
// and the registrar's NCCL ids (no GPU needed: the tables only).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "actors/node.hpp"
#include "actors/runtime.hpp"
#include "compute/checkpoint/checkpoint.hpp"
#include "node_jobs.hpp"
#include "messages/node_messages.hpp"

using namespace troupe;

namespace {

/// An address table of groups of two ranks, one per entry of `entries` (in order), rank 0
/// with GPU key `gpu0`, rank 1 with `gpu1`; no NCCL ids yet.
node_addresses two_rank_table(const std::vector<std::int32_t>& entries, const std::string& gpu0,
                              const std::string& gpu1) {
  node_addresses t;
  for (const auto entry : entries)
    for (int rank = 0; rank < 2; ++rank) {
      t.stages.push_back(entry);
      t.replicas.push_back(rank);
      t.addresses.emplace_back("a");
      t.machines.emplace_back("m");
      t.gpus.push_back(rank == 0 ? gpu0 : gpu1);
      t.nccl_ids.emplace_back();
    }
  return t;
}

}  // namespace

// A shard group runs its collectives over NCCL only when every member asked for it (named
// its GPU) and no two members share a GPU; the reason otherwise names the ranks.
TEST(MultiProcessNccl, GroupsNeedEveryMemberOnAGpuOfItsOwn) {
  EXPECT_EQ(nccl_refusal({"m1/gpu 0000:18:00.0", "m2/gpu 0000:18:00.0"}), "");  // two machines
  EXPECT_EQ(nccl_refusal({"m1/gpu 0000:18:00.0", "m1/gpu 0000:2a:00.0", "m1/gpu 0000:3a:00.0"}), "");
  const auto shared = nccl_refusal({"m1/gpu 0000:18:00.0", "m1/gpu 0000:2a:00.0", "m1/gpu 0000:18:00.0"});
  EXPECT_NE(shared.find("ranks 0 and 2 share a GPU (m1/gpu 0000:18:00.0)"), std::string::npos) << shared;
  const auto absent = nccl_refusal({"m1/gpu 0000:18:00.0", "", "m2/gpu 0000:18:00.0", ""});
  EXPECT_NE(absent.find("rank(s) 1, 3 did not ask for NCCL"), std::string::npos) << absent;
  EXPECT_NE(nccl_refusal({"m1/gpu 0000:18:00.0"}), "");
  EXPECT_NE(nccl_refusal({}), "");
}

TEST(MultiProcessNccl, LinksJoinTheNodesOfStagesThatPassTensors) {
  using pairs = std::vector<std::pair<int, int>>;
  // A pipeline of 4 over 4 nodes: neighbours both ways, and the first with the last.
  EXPECT_EQ(link_pairs(4, 1, 4), (pairs{{0, 1}, {0, 3}, {1, 0}, {1, 2}, {2, 1}, {2, 3}, {3, 0}, {3, 2}}));
  // Whole replicas per node: no tensors between nodes.
  EXPECT_EQ(link_pairs(2, 2, 2), pairs{});
  // p=4, d=2 on 4 nodes: each replica over two nodes (its first and last stage too).
  EXPECT_EQ(link_pairs(4, 2, 4), (pairs{{0, 1}, {1, 0}, {2, 3}, {3, 2}}));
  // p=3, d=2 on 3 nodes: node 1 hosts replica 0's last stage and replica 1's first.
  EXPECT_EQ(link_pairs(3, 2, 3), (pairs{{0, 1}, {1, 0}, {1, 2}, {2, 1}}));
}

// The registrar's table of p=2, d=2 on 4 nodes (stage 0's ranks on nodes 0 and 2, stage
// 1's on nodes 1 and 3), each node's entries with its GPU key (empty: it did not ask).
node_addresses table_of(const std::vector<std::string>& gpus) {
  node_addresses t;
  auto add = [&](int stage, int rank, int node) {
    t.stages.push_back(stage);
    t.replicas.push_back(rank);
    t.addresses.push_back(stage <= -2 ? "" : "ucx address");
    t.machines.push_back("m");
    t.gpus.push_back(stage <= -2 ? "" : gpus[node]);
    t.nccl_ids.emplace_back();
  };
  for (int node = 0; node < 4; ++node) {
    add(node % 2, node / 2, node);  // its slot
    add(-1, node, node);            // the world
    for (const auto& [from, to] : link_pairs(2, 2, 4))
      if (from == node && !gpus[node].empty()) add(-2 - from, to, node);
  }
  return t;
}

// Ids exactly where they are used: the rank 0 entry of each shard group and each link
// that nccl_refusal accepts. An id made for nothing would leave NCCL's bootstrap thread
// waiting for ranks that never come.
TEST(MultiProcessNccl, TheRegistrarMakesIdsOnlyWhereNcclRuns) {
  int made = 0;
  auto make_id = [&] { return "id " + std::to_string(made++); };
  auto ids_of = [](const node_addresses& t) {
    std::map<std::pair<int, int>, std::string> out;  // (stage, replica) -> id, where given
    for (std::size_t i = 0; i < t.stages.size(); ++i)
      if (!t.nccl_ids.at(i).empty()) out[{t.stages[i], t.replicas[i]}] = t.nccl_ids[i];
    return out;
  };
  using ids = std::map<std::pair<int, int>, std::string>;
  // A GPU each: both groups (in rank 0's entry) and the four links (entries -2 - from).
  auto t = table_of({"m/gpu 0", "m/gpu 1", "m/gpu 2", "m/gpu 3"});
  EXPECT_EQ(assign_nccl_ids(t, make_id), 6);
  EXPECT_EQ(made, 6);
  EXPECT_EQ(ids_of(t), (ids{{{0, 0}, "id 0"}, {{-2, 1}, "id 1"}, {{1, 0}, "id 2"},
                            {{-3, 0}, "id 3"}, {{-4, 3}, "id 4"}, {{-5, 2}, "id 5"}}));
  // One GPU for all: every group and link is refused, and no id is made.
  made = 0;
  t = table_of({"m/gpu 0", "m/gpu 0", "m/gpu 0", "m/gpu 0"});
  EXPECT_EQ(assign_nccl_ids(t, make_id), 0);
  EXPECT_EQ(made, 0);
  EXPECT_EQ(ids_of(t), ids{});
  // Node 3 did not ask: stage 1's group (nodes 1 and 3) and the link 2 -> 3 stay off.
  t = table_of({"m/gpu 0", "m/gpu 1", "m/gpu 2", ""});
  EXPECT_EQ(assign_nccl_ids(t, make_id), 3);
  EXPECT_EQ(ids_of(t), (ids{{{0, 0}, "id 0"}, {{-2, 1}, "id 1"}, {{-3, 0}, "id 2"}}));
  // Making an id failed: nothing given, and the nodes find no id (they stay on UCX).
  made = 0;
  t = table_of({"m/gpu 0", "m/gpu 1", "m/gpu 2", "m/gpu 3"});
  EXPECT_EQ(assign_nccl_ids(t, [&] { ++made; return std::string(); }), 0);
  EXPECT_EQ(made, 6);
  EXPECT_EQ(ids_of(t), ids{});
}

// A tensor-parallel group spread over two nodes (entry tensor_group_entry, rank tp): an id
// in its rank 0's entry where each member has a GPU of its own, none where they share one.
TEST(MultiProcessNccl, TheRegistrarMakesIdsForTensorParallelGroupsSpreadOverNodes) {
  auto table_of = [](const std::string& gpu0, const std::string& gpu1) {
    return two_rank_table({tensor_group_entry(0, 0, 1)}, gpu0, gpu1);
  };
  int made = 0;
  auto make_id = [&] { return "id " + std::to_string(made++); };
  auto t = table_of("m/gpu 0", "m/gpu 1");
  EXPECT_EQ(assign_nccl_ids(t, make_id), 1);
  EXPECT_EQ(t.nccl_ids, (std::vector<std::string>{"id 0", ""}));
  t = table_of("m/gpu 0", "m/gpu 0");
  EXPECT_EQ(assign_nccl_ids(t, make_id), 0);
  EXPECT_EQ(made, 1);
}

// An expert shard group (entry expert_shard_entry, rank q / EP) and an expert group (the
// all-to-alls: entry expert_group_entry, rank q mod EP): an id in each one's rank 0's
// entry where each member has a GPU of its own, none where they share one.
TEST(MultiProcessNccl, TheRegistrarMakesIdsForExpertShardGroupsAndExpertGroups) {
  auto table_of = [](const std::string& gpu0, const std::string& gpu1) {
    return two_rank_table({expert_shard_entry(1, 1, 2), expert_group_entry(1, 0, 2, false)}, gpu0, gpu1);
  };
  EXPECT_TRUE(is_expert_shard_entry(expert_shard_entry(3, 7, 8)));
  EXPECT_FALSE(is_expert_shard_entry(expert_group_entry(3, 7, 8, true)));
  EXPECT_FALSE(is_expert_shard_entry(tensor_group_entry(0, 0, 1)));
  EXPECT_TRUE(is_expert_group_entry(expert_group_entry(3, 7, 8, true)));
  EXPECT_FALSE(is_expert_group_entry(expert_shard_entry(0, 0, 1)));
  EXPECT_FALSE(is_expert_group_entry(-2 - 5));  // a link's
  int made = 0;
  auto make_id = [&] { return "id " + std::to_string(made++); };
  auto t = table_of("m/gpu 0", "m/gpu 1");
  EXPECT_EQ(assign_nccl_ids(t, make_id), 2);
  EXPECT_EQ(t.nccl_ids, (std::vector<std::string>{"id 0", "", "id 1", ""}));
  t = table_of("m/gpu 0", "m/gpu 0");
  EXPECT_EQ(assign_nccl_ids(t, make_id), 0);
  EXPECT_EQ(made, 2);
}
