#include <gtest/gtest.h>

#include "compute/data/data.hpp"
#include "compute/runtime/splitmix.hpp"

namespace troupe {

TEST(Splitmix, CheckValueOfWorkloads) { EXPECT_EQ(splitmix64(0), 16294208416658607535ULL); }

TEST(Splitmix, KeyIsSeedTimesTwoToThe32PlusIndex) {
  EXPECT_EQ(seeded_key(1234, 5), (std::uint64_t(1234) << 32) + 5);
  EXPECT_NE(splitmix64(seeded_key(1234, 0)), splitmix64(seeded_key(1235, 0)));
}

// WORKLOADS.md's check values for Debian 12's fortunes package.
TEST(Splitmix, FortunesCheckValues) {
  text_corpus corpus;
  EXPECT_EQ(corpus.size(), 2576674u);
  EXPECT_EQ(corpus.n_train(), 2319006u);
  EXPECT_EQ(corpus.train_offset(1234, 0, 128), 2193181u);
  EXPECT_EQ(corpus.train_offset(1234, 1, 128), 1180421u);
  EXPECT_EQ(corpus.train_offset(1234, 2, 128), 350264u);
}

}  // namespace troupe
