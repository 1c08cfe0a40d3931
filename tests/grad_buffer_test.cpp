#include <gtest/gtest.h>

#include "compute/grad_buffer.hpp"
#include "compute/partition.hpp"

namespace troupe {

namespace {
std::unique_ptr<model_slice> full_gpt(std::int64_t pad_to) {
  const auto spec = model_spec::gpt_tiny();
  return make_slice(spec, partition_layers(8, 1)[0], initial_state(spec, 1), pad_to);
}
}  // namespace

TEST(GradBuffer, ShardRangesAreEqualAndCoverTheBuffer) {
  auto r = shard_ranges(12, 3);
  ASSERT_EQ(r.size(), 3u);
  EXPECT_EQ(r[0], (flat_range{0, 4}));
  EXPECT_EQ(r[2], (flat_range{8, 12}));
  EXPECT_THROW(shard_ranges(10, 3), std::invalid_argument);
}

TEST(GradBuffer, PiecesMapEveryParameterElementToExactlyOneShard) {
  for (int d : {1, 2, 3, 4}) {
    auto slice = full_gpt(d);
    const auto ranges = shard_ranges(slice->flat_grads().numel(), d);
    std::vector<std::int64_t> covered(slice->entries().size(), 0);
    std::vector<int> shards_per_param(slice->entries().size(), 0);
    for (const auto& range : ranges) {
      for (const auto& piece : shard_pieces(slice->entries(), range)) {
        const auto& e = slice->entries()[piece.entry];
        EXPECT_EQ(piece.in_param.size(), piece.in_shard.size());
        // The same element seen from the parameter and from the shard.
        EXPECT_EQ(e.offset + piece.in_param.begin, range.begin + piece.in_shard.begin);
        covered[piece.entry] += piece.in_param.size();
        ++shards_per_param[piece.entry];
        EXPECT_EQ(entry_at(slice->entries(), range.begin + piece.in_shard.begin), int(piece.entry));
      }
    }
    for (std::size_t i = 0; i < covered.size(); ++i) EXPECT_EQ(covered[i], slice->entries()[i].numel) << d;
    // Ranges ignore parameter boundaries: with d > 1 some parameter spans two shards.
    if (d > 1) {
      EXPECT_GT(*std::max_element(shards_per_param.begin(), shards_per_param.end()), 1);
    }
  }
}

TEST(GradBuffer, PaddingBelongsToNoParameter) {
  auto slice = full_gpt(7);
  ASSERT_GT(slice->flat_grads().numel(), slice->numel()) << "gpt-tiny's size is not a multiple of 7: padding expected";
  EXPECT_EQ(entry_at(slice->entries(), slice->numel()), -1);
  EXPECT_EQ(entry_at(slice->entries(), 0), 0);
}

TEST(GradBuffer, DecayMaskCoversTwoDimensionalWeightsButNotWpe) {
  auto slice = full_gpt(1);
  const flat_range all{0, slice->flat_grads().numel()};
  const auto mask = decay_mask(slice->entries(), all);
  for (const auto& e : slice->entries()) {
    const bool expected = e.shape.size() == 2 && e.name != "wpe.weight";
    EXPECT_EQ(mask.narrow(0, e.offset, e.numel).all().item<bool>(), expected) << e.name;
    EXPECT_EQ(mask.narrow(0, e.offset, e.numel).any().item<bool>(), expected) << e.name;
  }
  EXPECT_TRUE(norm_mask(slice->entries(), all).all().item<bool>());
}

}  // namespace troupe
