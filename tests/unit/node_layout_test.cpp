// Which (replica, stage) slots each node process of a job hosts.
#include <gtest/gtest.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "actors/node.hpp"
#include "actors/registrar_actor.hpp"
#include "actors/supervisor_actor.hpp"
#include "compute/config/job_config.hpp"

// Node layouts: equal runs of the replica-major (replica, stage) list.
TEST(NodeLayout, SlotsAreEqualRunsOfReplicaMajorStages) {
  using slots = std::vector<std::pair<int, int>>;
  EXPECT_EQ(troupe::node_slots(2, 2, 1, 2), (slots{{1, 0}, {1, 1}}));  // whole replicas
  EXPECT_EQ(troupe::node_slots(4, 1, 1, 2), (slots{{0, 2}, {0, 3}}));  // a pipeline split
  EXPECT_EQ(troupe::node_slots(2, 2, 3, 4), (slots{{1, 1}}));
  EXPECT_EQ(troupe::node_slots(1, 4, 0, 1).size(), 4u);
  EXPECT_THROW(troupe::node_slots(1, 2, 0, 3), troupe::config_error);
}

// Tensor parallelism: each (replica, stage) is t slots (pipeline dp t + tp), tp fastest,
// so a tensor-parallel group is never split between node processes.
TEST(NodeLayout, TensorParallelGroupsStayInsideOneNode) {
  using slots = std::vector<std::pair<int, int>>;
  EXPECT_EQ(troupe::node_slots(2, 2, 1, 2, 2), (slots{{2, 0}, {3, 0}, {2, 1}, {3, 1}}));  // replica 1
  EXPECT_EQ(troupe::node_slots(2, 1, 1, 2, 4), (slots{{0, 1}, {1, 1}, {2, 1}, {3, 1}}));  // stage 1
  EXPECT_EQ(troupe::node_slots(2, 2, 0, 1, 2).size(), 8u);
  for (int node = 0; node < 4; ++node)
    for (const auto& [q, k] : troupe::node_slots(2, 2, node, 4, 2)) {
      int peers = 0;  // the group of (q / 2, k) on this node
      for (const auto& [q2, k2] : troupe::node_slots(2, 2, node, 4, 2)) peers += q2 / 2 == q / 2 && k2 == k;
      EXPECT_EQ(peers, 2) << "node " << node;
    }
  EXPECT_THROW(troupe::node_slots(1, 2, 0, 3, 2), troupe::config_error);
  // More nodes than p x d (one GPU each): a group spreads over consecutive nodes.
  EXPECT_EQ(troupe::node_slots(2, 1, 1, 4, 2), (slots{{1, 0}}));  // stage 0's rank 1
  EXPECT_EQ(troupe::node_slots(2, 1, 2, 4, 2), (slots{{0, 1}}));
  EXPECT_EQ(troupe::node_slots(1, 2, 1, 2, 4), (slots{{4, 0}, {5, 0}, {6, 0}, {7, 0}}));  // whole again
  EXPECT_EQ(troupe::node_slots(1, 1, 1, 2, 4), (slots{{2, 0}, {3, 0}}));  // half a group
  EXPECT_THROW(troupe::node_slots(3, 1, 0, 4, 4), troupe::config_error);  // 3 each: neither
  // Rank tp of a stage sends to rank tp of the next: nodes 0 and 1 (stage 0) to 2 and 3.
  using pairs = std::vector<std::pair<int, int>>;
  EXPECT_EQ(troupe::link_pairs(2, 1, 4, 2), (pairs{{0, 2}, {1, 3}, {2, 0}, {3, 1}}));
  EXPECT_EQ(troupe::link_pairs(2, 2, 2, 2), pairs{});  // whole replicas per node
}

namespace {

/// A round's table as the nodes of `nodes` would send it for p stages, d data-parallel
/// replicas and t tensor-parallel ranks per replica: per slot an entry of its shard group
/// (stage k's, tensor-parallel rank q mod t; rank q / t), and per node a world entry (-1),
/// each with an address of 300 bytes naming it. Returns every node's own entries.
std::vector<troupe::node_addresses> sent_addresses(int p, int d, int t, int nodes) {
  std::vector<troupe::node_addresses> out;
  for (int node = 0; node < nodes; ++node) {
    troupe::node_addresses a;
    a.node = node;
    a.round = 1;
    auto add = [&](int group, int rank) {
      a.stages.push_back(group);
      a.replicas.push_back(rank);
      auto address = std::to_string(group) + "/" + std::to_string(rank) + "@" + std::to_string(node);
      address.resize(300, '.');
      a.addresses.push_back(address);
      a.machines.push_back("machine " + std::to_string(node / 8));
      a.gpus.push_back("");
    };
    for (const auto& [q, k] : troupe::node_slots(p, d, node, nodes, t)) add(k * t + q % t, q / t);
    add(-1, node);
    out.push_back(std::move(a));
  }
  return out;
}

troupe::node_addresses whole_table(const std::vector<troupe::node_addresses>& sent) {
  troupe::node_addresses t;
  for (const auto& a : sent) troupe::add_entries(t, a);
  t.nccl_ids.resize(t.stages.size());
  return t;
}

}  // namespace

// The registrar's answer to a node's addresses: the entries of its own shard groups and
// every world entry, with each kept entry's fields (and a group's NCCL id) as sent.
TEST(NodeLayout, ANodeGetsTheAddressesOfItsOwnGroupsAndTheWorld) {
  // p 4 x d 2 on 4 nodes: node 0 holds stages 0 and 1 of replica 0, node 2 those of replica 1.
  const auto sent = sent_addresses(4, 2, 1, 4);
  auto all = whole_table(sent);
  ASSERT_EQ(all.stages.size(), 12u);
  for (std::size_t i = 0; i < all.stages.size(); ++i)
    if (all.stages[i] == 0 && all.replicas[i] == 0) all.nccl_ids[i] = "id of group 0";
  const auto mine = troupe::table_for(all, sent[0]);
  ASSERT_EQ(mine.stages.size(), 8u);  // groups 0 and 1 (2 ranks each) and the 4 world entries
  ASSERT_EQ(mine.addresses.size(), 8u);
  ASSERT_EQ(mine.machines.size(), 8u);
  ASSERT_EQ(mine.gpus.size(), 8u);
  ASSERT_EQ(mine.nccl_ids.size(), 8u);
  int world = 0;
  for (std::size_t i = 0; i < mine.stages.size(); ++i) {
    const auto group = mine.stages[i], rank = mine.replicas[i];
    EXPECT_TRUE(group == -1 || group == 0 || group == 1) << group;
    world += group == -1;
    // The entry is the one sent: by its address, which names its group, rank and node.
    EXPECT_EQ(mine.addresses[i].substr(0, mine.addresses[i].find('@')),
              std::to_string(group) + "/" + std::to_string(rank));
    EXPECT_EQ(mine.nccl_ids[i], group == 0 && rank == 0 ? "id of group 0" : "");
  }
  EXPECT_EQ(world, 4);
  // Node 1 (stages 2 and 3): none of groups 0 and 1.
  for (const auto g : troupe::table_for(all, sent[1]).stages) EXPECT_TRUE(g == -1 || g == 2 || g == 3) << g;
  // Entries of negative ids (links, and groups spread over nodes: tensor, context and
  // expert parallelism) reach every node, whether it sent one of that id or not.
  const int spread = -(1 << 28) - 5, link = -2 - 3;
  for (const int g : {spread, link}) {
    all.stages.push_back(g);
    all.replicas.push_back(1);
    all.addresses.push_back("negative");
    all.machines.push_back("");
    all.gpus.push_back("");
    all.nccl_ids.push_back("");
  }
  const auto with_negative = troupe::table_for(all, sent[0]);
  EXPECT_EQ(with_negative.stages.size(), 10u);
  EXPECT_EQ(std::count(with_negative.stages.begin(), with_negative.stages.end(), spread), 1);
  EXPECT_EQ(std::count(with_negative.stages.begin(), with_negative.stages.end(), link), 1);

  // Llama 3's layout as 2,048 nodes of 8 ranks (TP 8 within a node, PP 16, DP 128): a
  // node's 8 shard groups of 128 ranks and the 2,048 world entries, a sixth of the table.
  const auto big = sent_addresses(16, 128, 8, 2048);
  const auto whole = whole_table(big);
  ASSERT_EQ(whole.stages.size(), 2048u * 9);
  for (const int node : {0, 1000, 2047})
    EXPECT_EQ(troupe::table_for(whole, big[std::size_t(node)]).addresses.size(), 8u * 128 + 2048) << node;
}
