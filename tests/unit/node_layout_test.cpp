// Which (replica, stage) slots each node process of a job hosts.
#include <gtest/gtest.h>

#include <utility>
#include <vector>

#include "actors/supervisor_actor.hpp"
#include "compute/job_config.hpp"

// Node layouts: equal runs of the replica-major (replica, stage) list.
TEST(NodeLayout, SlotsAreEqualRunsOfReplicaMajorStages) {
  using slots = std::vector<std::pair<int, int>>;
  EXPECT_EQ(troupe::node_slots(2, 2, 1, 2), (slots{{1, 0}, {1, 1}}));  // whole replicas
  EXPECT_EQ(troupe::node_slots(4, 1, 1, 2), (slots{{0, 2}, {0, 3}}));  // a pipeline split
  EXPECT_EQ(troupe::node_slots(2, 2, 3, 4), (slots{{1, 1}}));
  EXPECT_EQ(troupe::node_slots(1, 4, 0, 1).size(), 4u);
  EXPECT_THROW(troupe::node_slots(1, 2, 0, 3), troupe::config_error);
}
