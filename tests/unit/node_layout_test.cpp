// Which (replica, stage) slots each node process of a job hosts.
#include <gtest/gtest.h>

#include <utility>
#include <vector>

#include "actors/node.hpp"
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
