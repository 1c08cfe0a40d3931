// compute/models/partition.hpp: layers split into pipeline stages and virtual chunks.
#include <gtest/gtest.h>

#include "compute/models/partition.hpp"

namespace troupe {

TEST(Partition, EvenAndExplicitSplits) {
  auto r = partition_layers(8, 4);
  ASSERT_EQ(r.size(), 4u);
  EXPECT_EQ(r[1].first, 2);
  EXPECT_EQ(r[1].last, 4);
  EXPECT_TRUE(r[0].first_slice && !r[0].last_slice);
  EXPECT_TRUE(r[3].last_slice && !r[3].first_slice);
  auto uneven = partition_layers(8, 3);
  EXPECT_EQ(uneven[0].last - uneven[0].first, 3);
  EXPECT_EQ(uneven[2].last - uneven[2].first, 2);
  auto chunks = partition_layers(8, 2, 2);  // virtual stage x = chunk * p + stage
  EXPECT_EQ(chunks[1].stage, 1);
  EXPECT_EQ(chunks[1].chunk, 0);
  EXPECT_EQ(chunks[2].stage, 0);
  EXPECT_EQ(chunks[2].chunk, 1);
  EXPECT_EQ(chunks[2].first, 4);
  auto manual = partition_layers(8, 2, 1, {3, 5});
  EXPECT_EQ(manual[1].first, 3);
  EXPECT_THROW(partition_layers(8, 2, 1, {3, 4}), partition_error);
  EXPECT_THROW(partition_layers(8, 2, 1, {8, 0}), partition_error);
  EXPECT_THROW(partition_layers(8, 16), partition_error);
}

}  // namespace troupe
