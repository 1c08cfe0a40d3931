// Which (replica, stage) slots each node process of a job hosts.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>
#include <tuple>
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
/// each with an address of 300 bytes naming it, and its world peers. Returns every node's
/// own entries.
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
      a.gpus.push_back("gpu of node " + std::to_string(node));
    };
    for (const auto& [q, k] : troupe::node_slots(p, d, node, nodes, t)) add(k * t + q % t, q / t);
    add(-1, node);
    a.peers = troupe::world_peers(p, d, nodes, t, node);
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

// The nodes a node's world connects to: the other ends of its links (neighbouring stages
// of its replicas, and a replica's first and last), and the nodes its shards' buddy
// copies go to or come from (node n > 0 sends to node n + 1 mod N).
TEST(NodeLayout, TheWorldConnectsANodeToItsPipelineNeighboursAndBuddies) {
  using peers = std::vector<std::int32_t>;
  // p 4 x d 2 on 4 nodes: node 0 holds stages 0 and 1 of replica 0, node 1 stages 2 and 3.
  EXPECT_EQ(troupe::world_peers(4, 2, 4, 1, 0), (peers{1, 3}));
  EXPECT_EQ(troupe::world_peers(4, 2, 4, 1, 2), (peers{1, 3}));
  EXPECT_EQ(troupe::world_peers(2, 2, 1, 1, 0), peers{});  // one node: no world
  // Llama 3's layout as 2,048 nodes of one (replica, stage) each (TP 8 within the node).
  EXPECT_EQ(troupe::world_peers(16, 128, 2048, 8, 0), (peers{1, 15, 2047}));
  EXPECT_EQ(troupe::world_peers(16, 128, 2048, 8, 1000), (peers{999, 1001}));
  EXPECT_EQ(troupe::world_peers(16, 128, 2048, 8, 2047), (peers{0, 2032, 2046}));
  // Every layout, from node_slots' placement: the nodes of the neighbouring stages of
  // each of its pipelines (and of the first and the last), the buddies; and symmetric.
  for (const auto& [p, d, t, nodes] : {std::tuple{4, 2, 1, 8}, std::tuple{2, 4, 2, 8}, std::tuple{2, 1, 2, 4},
                                       std::tuple{3, 4, 1, 6}, std::tuple{8, 2, 1, 4}, std::tuple{4, 4, 2, 32},
                                       std::tuple{1, 4, 1, 4}})
    for (int node = 0; node < nodes; ++node) {
      std::map<std::pair<int, int>, int> node_of;  // (pipeline, stage) -> node
      for (int n = 0; n < nodes; ++n)
        for (const auto& slot : troupe::node_slots(p, d, n, nodes, t)) node_of[slot] = n;
      std::set<std::int32_t> want;
      for (const auto& [q, k] : troupe::node_slots(p, d, node, nodes, t))
        for (const int other : {k - 1, k + 1, k == 0 ? p - 1 : -1, k == p - 1 ? 0 : -1})
          if (other >= 0 && other < p) want.insert(node_of.at({q, other}));
      if (node > 0) want.insert((node + 1) % nodes);
      if ((node + nodes - 1) % nodes > 0) want.insert((node + nodes - 1) % nodes);
      want.erase(node);
      const auto got = troupe::world_peers(p, d, nodes, t, node);
      EXPECT_EQ(got, peers(want.begin(), want.end())) << p << "x" << d << "x" << t << " on " << nodes << ", node " << node;
      for (const auto other : got) {
        const auto back = troupe::world_peers(p, d, nodes, t, other);
        EXPECT_TRUE(std::count(back.begin(), back.end(), node)) << node << " and " << other;
      }
    }
}

// The registrar's answer to a node's addresses: the entries of its own groups, the world
// entries of its peers and its own, and the links it is an end of, with each kept entry's
// fields (and a group's NCCL id) as sent, but for the addresses of a group that runs over
// NCCL.
TEST(NodeLayout, ANodeGetsTheAddressesOfItsOwnGroupsAndItsWorldPeers) {
  // p 4 x d 2 on 4 nodes: node 0 holds stages 0 and 1 of replica 0, node 2 those of
  // replica 1; node 0's world peers are node 1 (stages 2 and 3 of replica 0, and its
  // buddy) and node 3 (whose buddy it is).
  const auto sent = sent_addresses(4, 2, 1, 4);
  auto all = whole_table(sent);
  ASSERT_EQ(all.stages.size(), 12u);
  for (std::size_t i = 0; i < all.stages.size(); ++i)
    if (all.stages[i] == 0 && all.replicas[i] == 0) all.nccl_ids[i] = "id of group 0";
  const auto mine = troupe::table_for(all, sent[0]);
  ASSERT_EQ(mine.stages.size(), 7u);  // groups 0 and 1 (2 ranks each), the world entries of nodes 0, 1, 3
  ASSERT_EQ(mine.addresses.size(), 7u);
  ASSERT_EQ(mine.machines.size(), 7u);
  ASSERT_EQ(mine.gpus.size(), 7u);
  ASSERT_EQ(mine.nccl_ids.size(), 7u);
  std::vector<int> world;
  for (std::size_t i = 0; i < mine.stages.size(); ++i) {
    const auto group = mine.stages[i], rank = mine.replicas[i];
    EXPECT_TRUE(group == -1 || group == 0 || group == 1) << group;
    if (group == -1) world.push_back(rank);
    // The entry is the one sent: by its address, which names its group, rank and node;
    // group 0 runs over NCCL (it has an id), so its members get no addresses of it.
    if (group == 0)
      EXPECT_EQ(mine.addresses[i], "");
    else
      EXPECT_EQ(mine.addresses[i].substr(0, mine.addresses[i].find('@')),
                std::to_string(group) + "/" + std::to_string(rank));
    EXPECT_EQ(mine.machines[i], "machine 0");  // (nodes 0-7 share a machine)
    EXPECT_EQ(mine.gpus[i].rfind("gpu of node ", 0), 0u) << i;
    EXPECT_EQ(mine.nccl_ids[i], group == 0 && rank == 0 ? "id of group 0" : "");
  }
  EXPECT_EQ(world, (std::vector<int>{0, 1, 3}));
  // A node that names no peers gets every world entry.
  auto no_peers = sent[0];
  no_peers.peers.clear();
  EXPECT_EQ(troupe::table_for(all, no_peers).stages.size(), 8u);
  // Node 1 (stages 2 and 3): none of groups 0 and 1.
  for (const auto g : troupe::table_for(all, sent[1]).stages) EXPECT_TRUE(g == -1 || g == 2 || g == 3) << g;
  // Entries of negative ids: a link reaches its two ends; a group spread over nodes
  // (tensor, context and expert parallelism) reaches the nodes that sent an entry of it.
  const int spread = -(1 << 28) - 5, other_spread = -(1 << 28) - 6;
  const int link_to_0 = troupe::link_entry(3), link_from_0 = troupe::link_entry(0), link_1_3 = troupe::link_entry(1);
  const std::vector<std::pair<int, int>> extra{
      {spread, 1}, {other_spread, 0}, {link_to_0, 0}, {link_from_0, 1}, {link_1_3, 3}};
  auto node0 = sent[0];
  node0.stages.push_back(spread);  // node 0 is rank 0 of group `spread`
  for (const auto& [g, rank] : extra) {
    all.stages.push_back(g);
    all.replicas.push_back(rank);
    all.addresses.push_back("negative");
    all.machines.push_back("");
    all.gpus.push_back("");
    all.nccl_ids.push_back("");
  }
  const auto with_negative = troupe::table_for(all, node0);
  EXPECT_EQ(with_negative.stages.size(), 10u);
  for (const int g : {spread, link_to_0, link_from_0})
    EXPECT_EQ(std::count(with_negative.stages.begin(), with_negative.stages.end(), g), 1) << g;
  for (const int g : {other_spread, link_1_3})
    EXPECT_EQ(std::count(with_negative.stages.begin(), with_negative.stages.end(), g), 0) << g;

  // Llama 3's layout as 2,048 nodes of 8 ranks (TP 8 within a node, PP 16, DP 128): a
  // node's 8 shard groups of 128 ranks and the world entries of itself and its 2 or 3
  // peers, not the 18,432 of the whole table.
  const auto big = sent_addresses(16, 128, 8, 2048);
  const auto whole = whole_table(big);
  ASSERT_EQ(whole.stages.size(), 2048u * 9);
  for (const auto& [node, size] : {std::pair{0, 1028u}, std::pair{1000, 1027u}, std::pair{2047, 1028u}})
    EXPECT_EQ(troupe::table_for(whole, big[std::size_t(node)]).addresses.size(), size) << node;
}
