#include <gtest/gtest.h>

#include <map>
#include <set>

#include "compute/models/model.hpp"
#include "compute/runtime/device.hpp"
#include "compute/optim/grad_buffer.hpp"
#include "compute/models/partition.hpp"

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
      for (const auto& piece : shard_pieces(slice->entries(), {range})) {
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
  const auto& entries = slice->entries();
  EXPECT_EQ(entry_at(entries, entries.back().offset + entries.back().numel), -1);
  EXPECT_EQ(entry_at(entries, 0), 0);
  // Each block begins at a multiple of the padding (a unit of FSDP by blocks): the gaps
  // before them are padding too.
  int gaps = 0;
  for (std::size_t i = 1; i < entries.size(); ++i) {
    const auto end = entries[i - 1].offset + entries[i - 1].numel;
    if (slice->entry_block(i) != slice->entry_block(i - 1)) EXPECT_EQ(entries[i].offset % 7, 0) << entries[i].name;
    if (entries[i].offset == end) continue;
    ++gaps;
    EXPECT_NE(slice->entry_block(i), slice->entry_block(i - 1)) << entries[i].name;
    EXPECT_EQ(entry_at(entries, end), -1) << entries[i].name;
  }
  EXPECT_GT(gaps, 0);
}

TEST(GradBuffer, DecayMaskCoversTwoDimensionalWeightsButNotWpe) {
  auto slice = full_gpt(1);
  const flat_range all{0, slice->flat_grads().numel()};
  const auto mask = decay_mask(slice->entries(), {all});
  for (const auto& e : slice->entries()) {
    const bool expected = e.shape.size() == 2 && e.name != "wpe.weight";
    EXPECT_EQ(mask.narrow(0, e.offset, e.numel).all().item<bool>(), expected) << e.name;
    EXPECT_EQ(mask.narrow(0, e.offset, e.numel).any().item<bool>(), expected) << e.name;
  }
  EXPECT_TRUE(norm_mask(slice->entries(), {all}).all().item<bool>());
}

TEST(GradBuffer, BucketsCoverTheBufferInMultiplesOfTheRanksAndEndWhereParametersBegin) {
  for (int d : {1, 2, 3, 4}) {
    auto slice = full_gpt(d);
    const auto n = slice->flat_grads().numel();
    EXPECT_EQ(grad_buckets(slice->entries(), n, d, 0), (std::vector<flat_range>{{0, n}}));
    for (std::int64_t elems : std::vector<std::int64_t>{1, 5000, 60000, n, 4 * n}) {
      const auto buckets = grad_buckets(slice->entries(), n, d, elems);
      ASSERT_FALSE(buckets.empty());
      EXPECT_EQ(buckets.front().begin, 0);
      EXPECT_EQ(buckets.back().end, n);
      for (std::size_t b = 0; b < buckets.size(); ++b) {
        EXPECT_EQ(buckets[b].size() % d, 0) << d << " " << elems;
        if (b > 0) {
          EXPECT_EQ(buckets[b].begin, buckets[b - 1].end);
          // Every bucket but the first holds at least `elems` elements and begins where a
          // parameter does (rounded down to a multiple of d).
          EXPECT_GE(buckets[b].size(), elems);
          bool at_param = false;
          for (const auto& e : slice->entries()) at_param |= e.offset / d * d == buckets[b].begin;
          EXPECT_TRUE(at_param) << buckets[b].begin;
        }
      }
      if (elems >= n) EXPECT_EQ(buckets.size(), 1u);
      if (elems == 1) EXPECT_GE(buckets.size(), slice->entries().size() / 2) << "about one bucket per parameter";
    }
  }
  EXPECT_THROW(grad_buckets({}, 10, 3, 4), std::invalid_argument);
}

TEST(GradBuffer, BucketShardsSplitEveryBucketEquallyAndMapEachElementOnce) {
  const int d = 3;
  auto slice = full_gpt(d);
  const auto& entries = slice->entries();
  const auto n = slice->flat_grads().numel();
  const auto buckets = grad_buckets(entries, n, d, 40000);
  ASSERT_GT(buckets.size(), 3u);
  std::vector<std::int64_t> covered(entries.size(), 0);
  const flat_range all{0, n};
  const auto all_decay = decay_mask(entries, {all}), all_norm = norm_mask(entries, {all});
  for (int r = 0; r < d; ++r) {
    const auto layout = bucket_shard(buckets, d, r);
    ASSERT_EQ(layout.size(), buckets.size());
    std::int64_t base = 0;
    std::vector<torch::Tensor> decay_parts, norm_parts;
    for (std::size_t b = 0; b < buckets.size(); ++b) {
      EXPECT_EQ(layout[b].size() * d, buckets[b].size());
      EXPECT_EQ(layout[b].begin, buckets[b].begin + r * layout[b].size());
      decay_parts.push_back(all_decay.narrow(0, layout[b].begin, layout[b].size()));
      norm_parts.push_back(all_norm.narrow(0, layout[b].begin, layout[b].size()));
      base += layout[b].size();
    }
    EXPECT_EQ(shard_size(layout), base);
    // The shard is the concatenation of its ranges: pieces and masks agree with that.
    for (const auto& piece : shard_pieces(entries, layout)) {
      const auto& e = entries[piece.entry];
      std::int64_t flat = -1, at = 0;
      for (const auto& range : layout) {
        if (piece.in_shard.begin < at + range.size()) {
          flat = range.begin + piece.in_shard.begin - at;
          EXPECT_LE(piece.in_shard.end, at + range.size()) << "a piece spans two ranges";
          break;
        }
        at += range.size();
      }
      EXPECT_EQ(flat, e.offset + piece.in_param.begin) << e.name;
      covered[piece.entry] += piece.in_param.size();
    }
    EXPECT_TRUE(decay_mask(entries, layout).equal(torch::cat(decay_parts)));
    EXPECT_TRUE(norm_mask(entries, layout).equal(torch::cat(norm_parts)));
  }
  for (std::size_t i = 0; i < entries.size(); ++i) EXPECT_EQ(covered[i], entries[i].numel) << entries[i].name;
}

TEST(GradBuffer, ABufferComesBackFromItsBucketShardsInRankOrder) {
  const int d = 3;
  auto slice = full_gpt(d);
  const auto n = slice->flat_grads().numel();
  const auto whole = torch::arange(n, torch::kFloat64);
  for (std::int64_t elems : {0, 30000}) {
    const auto buckets = grad_buckets(slice->entries(), n, d, elems);
    std::vector<torch::Tensor> shards;  // what a whole-shard all-gather puts together
    for (int r = 0; r < d; ++r)
      for (const auto& piece : bucket_shard(buckets, d, r)) shards.push_back(whole.narrow(0, piece.begin, piece.size()));
    const auto gathered = torch::cat(shards);
    EXPECT_TRUE(from_rank_order(gathered, buckets, d).equal(whole)) << elems;
    if (elems) EXPECT_FALSE(gathered.equal(whole)) << "several buckets: rank order is not buffer order";
  }
}

// A slice holding one share of the experts (expert_share): the dense parameters first,
// padded to the data-parallel width, then its experts, padded to the expert-data-parallel
// width; buckets of each region over its own group, none across the boundary; the two
// groups' whole-shard all-gathers (dense region in rank order, then the experts' in theirs)
// put the buffer back.
TEST(GradBuffer, AnExpertRegionIsShardedOverItsOwnGroup) {
  auto spec = model_spec::moe_tiny();
  const int d = 3, share = 1, ep = 2, edp = 5;
  const auto slice = make_slice(spec, partition_layers(spec.n_layers(), 1)[0], initial_state(spec, 1), d,
                                torch::kCPU, torch::kFloat32, {}, expert_share{share, ep, edp});
  const auto n = slice->flat_grads().numel(), split = slice->expert_offset();
  ASSERT_LT(split, n);
  EXPECT_EQ(split % d, 0);
  EXPECT_EQ((n - split) % edp, 0);
  // Only experts 2 and 3 of each layer (4 experts over 2 ranks), all of them past the split.
  int experts = 0;
  for (const auto& e : slice->entries()) {
    const int x = expert_of(e.name);
    EXPECT_EQ(x < 0, e.offset < split) << e.name;
    if (x < 0) continue;
    ++experts;
    EXPECT_TRUE(x == 2 || x == 3) << e.name;
  }
  EXPECT_EQ(experts, 2 * 3 * spec.decoder.n_layer);  // (w1, w2, w3)
  EXPECT_EQ(slice->numel(), parameter_count(spec) - 2 * 3 * spec.decoder.n_layer * spec.decoder.d_model *
                                                         spec.decoder.expert_d_ff());
  const auto whole = torch::arange(n, torch::kFloat64);
  for (std::int64_t elems : {0, 5000}) {
    shard_groups g{d, 0, split, edp, 0};
    const auto buckets = slice_buckets(*slice, g, elems);
    for (const auto& b : buckets) {
      EXPECT_TRUE(b.end <= split || b.begin >= split) << "a bucket spans both regions";
      EXPECT_EQ(b.size() % g.ranks_of(b), 0);
    }
    EXPECT_EQ(buckets.front().begin, 0);
    EXPECT_EQ(buckets.back().end, n);
    if (elems) EXPECT_GT(buckets.size(), 3u);
    // Each group's ranks in order: the dense region's (d), then the experts' (edp).
    std::vector<torch::Tensor> shards;
    for (const bool in_experts : {false, true})
      for (int r = 0; r < (in_experts ? edp : d); ++r) {
        g.rank = in_experts ? 0 : r;
        g.expert_rank = in_experts ? r : 0;
        const auto layout = bucket_shard(buckets, g);
        for (std::size_t b = 0; b < buckets.size(); ++b)
          if (g.in_experts(buckets[b]) == in_experts)
            shards.push_back(whole.narrow(0, layout[b].begin, layout[b].size()));
      }
    EXPECT_TRUE(from_rank_order(torch::cat(shards), buckets, g).equal(whole)) << elems;
  }
  // Without a share: every expert, in the model's order, and no expert region.
  const auto all = make_slice(spec, partition_layers(spec.n_layers(), 1)[0], initial_state(spec, 1), d);
  EXPECT_EQ(all->expert_offset(), all->flat_grads().numel());
  EXPECT_EQ(all->numel(), parameter_count(spec));
}

TEST(GradBuffer, BucketShardsRestoreAndGatherTheSameMomentsByName) {
  const int d = 2;
  auto slice = full_gpt(d);
  const auto& entries = slice->entries();
  const auto buckets = grad_buckets(entries, slice->flat_grads().numel(), d, 30000);
  ASSERT_GT(buckets.size(), 2u);
  std::map<std::string, torch::Tensor> params, optim;
  torch::manual_seed(3);
  for (const auto& e : entries) {
    params[e.name] = torch::randn({e.numel});
    optim["exp_avg." + e.name] = torch::randn({e.numel});
    optim["exp_avg_sq." + e.name] = torch::rand({e.numel});
  }
  named_moments all;
  for (int r = 0; r < d; ++r) {
    const auto layout = bucket_shard(buckets, d, r);
    adamw_shard shard(torch::zeros({shard_size(layout)}), decay_mask(entries, layout), adamw_options{});
    restore_shard(entries, layout, shard, params, optim, 7);
    EXPECT_EQ(shard.steps(), 7);
    gather_moments(entries, layout, shard, all, /*main_params=*/true);
  }
  for (const auto& e : entries) {
    EXPECT_TRUE(all.main_params.at(e.name).equal(params.at(e.name))) << e.name;
    EXPECT_TRUE(all.exp_avg.at(e.name).equal(optim.at("exp_avg." + e.name))) << e.name;
    EXPECT_TRUE(all.exp_avg_sq.at(e.name).equal(optim.at("exp_avg_sq." + e.name))) << e.name;
  }
}

}  // namespace troupe
