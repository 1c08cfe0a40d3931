#include <gtest/gtest.h>

#include <set>

#include "compute/data.hpp"

namespace troupe {

TEST(Data, FortunesSampleDependsOnlyOnSeedAndGlobalIndex) {
  fortunes_corpus corpus;
  const auto whole = corpus.train_batch(1234, 64, 8, 128);
  for (int i = 0; i < 8; ++i) {
    const auto one = corpus.train_batch(1234, 64 + i, 1, 128);
    EXPECT_TRUE(torch::equal(whole.input[i], one.input[0]));
    EXPECT_TRUE(torch::equal(whole.target[i], one.target[0]));
  }
  // Target is the input shifted by one byte, taken from the corpus at the offset.
  const auto off = corpus.train_offset(1234, 64, 128);
  EXPECT_EQ(whole.input[0][0].item<std::int64_t>(), corpus.bytes()[off]);
  EXPECT_EQ(whole.target[0][127].item<std::int64_t>(), corpus.bytes()[off + 128]);
  EXPECT_TRUE(torch::equal(whole.input[0].slice(0, 1), whole.target[0].slice(0, 0, 127)));
  EXPECT_FALSE(torch::equal(corpus.train_batch(1, 64, 1, 128).input, corpus.train_batch(2, 64, 1, 128).input));
}

TEST(Data, FortunesValidationWindowsAreFixedAndInTheValidationSplit) {
  fortunes_corpus corpus;
  const auto v = corpus.validation_batch(128);
  ASSERT_EQ(v.input.sizes(), (std::vector<std::int64_t>{32, 128}));
  const std::size_t stride = (corpus.n_valid() - 129) / 32;
  for (int i : {0, 17, 31})
    EXPECT_EQ(v.input[i][0].item<std::int64_t>(), corpus.bytes()[corpus.n_train() + i * stride]);
}

TEST(Data, MissingFortunesNamesThePackage) {
  try {
    fortunes_corpus corpus("/nonexistent/fortunes");
    FAIL() << "no error for a missing corpus";
  } catch (const data_error& e) {
    EXPECT_NE(std::string(e.what()).find("apt-get install fortunes"), std::string::npos) << e.what();
  }
}

TEST(Data, FashionMnistLoadsAndEpochOrderIsAPermutation) {
  fashion_mnist data;
  EXPECT_EQ(data.train_size(), 60000);
  EXPECT_EQ(data.test_size(), 10000);
  const auto order = data.epoch_order(1234, 0);
  std::set<std::int64_t> seen(order.begin(), order.end());
  EXPECT_EQ(seen.size(), 60000u);
  EXPECT_EQ(*seen.begin(), 0);
  EXPECT_EQ(*seen.rbegin(), 59999);
  EXPECT_NE(order, data.epoch_order(1234, 1));
  const auto b = data.train_batch(order, 64, 16);
  EXPECT_EQ(b.input.sizes(), (std::vector<std::int64_t>{16, 784}));
  // Normalised with mean 0.2860, std 0.3530: the data set's mean is near 0.
  const auto test = data.test_set();
  EXPECT_NEAR(test.input.mean().item<double>(), 0.0, 0.05);
  EXPECT_EQ(test.target.max().item<std::int64_t>(), 9);
}

TEST(Data, MissingFashionMnistNamesThePackage) {
  try {
    fashion_mnist data("/nonexistent");
    FAIL() << "no error for missing Fashion-MNIST";
  } catch (const data_error& e) {
    EXPECT_NE(std::string(e.what()).find("dataset-fashion-mnist"), std::string::npos) << e.what();
  }
}

}  // namespace troupe
