// compute/optim/fsdp.hpp: a released storage refilled before the backward serves the
// saved tensors that view it; a slice's ops over an in-process group of ranks give the
// gradients of the whole batch, summed over the ranks, in each rank's pieces; by blocks,
// each block gathered for its forward and again for its backward, released after each and
// its gradients reduced as its backward ends, in that exact order.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "actors/tp_groups.hpp"
#include "compute/config/job_config.hpp"
#include "compute/models/model.hpp"
#include "compute/models/partition.hpp"
#include "compute/models/parameters.hpp"
#include "compute/optim/fsdp.hpp"
#include "compute/optim/grad_buffer.hpp"
#include "test_util.hpp"

namespace troupe {

namespace {

/// A small decoder of `workload`'s family: width 32, 2 heads (llama: 1 kv head), sequences
/// of 16.
model_spec small_spec(const std::string& workload, int layers) {
  auto cfg = job_config::defaults_for(workload);
  cfg.layers = layers;
  cfg.d_model = 32;
  cfg.heads = 2;
  if (workload == "llama-tiny") cfg.kv_heads = 1;
  cfg.seq_len = 16;
  return cfg.model();
}

/// small_spec's whole model (initial_state seed 3) as one slice; `ranks` batches of 2
/// sequences, and the reference: the slice (padded for `ranks`) with the gradients of all
/// of them summed.
struct reference_batches {
  model_spec spec;
  state_dict init;
  layer_range range;
  std::vector<torch::Tensor> tokens, targets;
  std::unique_ptr<model_slice> whole;
};
reference_batches summed_reference(const std::string& workload, int layers, int ranks) {
  reference_batches out;
  out.spec = small_spec(workload, layers);
  out.init = initial_state(out.spec, 3);
  out.range = partition_layers(out.spec.decoder.n_layer, 1)[0];
  torch::manual_seed(1);
  for (int r = 0; r < ranks; ++r) {
    out.tokens.push_back(torch::randint(0, out.spec.decoder.vocab, {2, 16}, torch::kInt64));
    out.targets.push_back(torch::randint(0, out.spec.decoder.vocab, {2, 16}, torch::kInt64));
  }
  out.whole = make_slice(out.spec, out.range, out.init, ranks, torch::kCPU, torch::kFloat32, {}, {});
  for (int r = 0; r < ranks; ++r) out.whole->loss(out.whole->forward(out.tokens[r]), out.targets[r]).backward();
  return out;
}

/// Each rank's reduced pieces `got[r]` (its `layouts[r]`) are `whole`'s gradients there.
void expect_pieces_of(const model_slice& whole, const std::vector<shard_layout>& layouts,
                      const std::vector<torch::Tensor>& got) {
  for (std::size_t r = 0; r < got.size(); ++r) {
    std::vector<torch::Tensor> mine;
    for (const auto& piece : layouts[r]) mine.push_back(whole.flat_grads().narrow(0, piece.begin, piece.size()));
    EXPECT_LE((got[r] - torch::cat(mine)).abs().max().item<double>(), 1e-6) << "rank " << r;
  }
}

}  // namespace

TEST(Fsdp, AReleasedStorageRefilledBeforeTheBackwardServesItsSavedViews) {
  torch::manual_seed(0);
  auto flat = torch::randn({12});
  auto w = flat.narrow(0, 0, 12).view({3, 4}).detach().requires_grad_(true);
  const auto x = torch::randn({2, 4});
  const auto want = flat.view({3, 4}).clone().requires_grad_(true);
  torch::matmul(x, want.t()).pow(2).sum().backward();
  const auto keep = flat.clone();
  auto y = torch::matmul(x, w.t()).pow(2).sum();
  const auto bytes = flat.storage().nbytes();
  release_storage(w);
  EXPECT_FALSE(storage_held(flat));
  EXPECT_EQ(held_bytes(flat), 0u);
  // Refilled through an alias with a version counter of its own (what the all-gather
  // writes into): the saved views keep their versions, so the backward runs. From a
  // pool: the block a release gave back.
  storage_pool pool;
  materialize_storage(w, bytes, &pool);
  EXPECT_TRUE(storage_held(flat));
  torch::from_blob(flat.data_ptr(), {12}, flat.options()).copy_(keep);
  y.backward();
  const auto* block = flat.data_ptr();
  release_storage(w, &pool);
  EXPECT_EQ(pool.held(), bytes);
  materialize_storage(w, bytes, &pool);
  EXPECT_EQ(flat.data_ptr(), block);
  EXPECT_EQ(pool.held(), 0u);
  EXPECT_EQ(held_bytes(flat), bytes);
  EXPECT_TRUE(torch::equal(w.grad(), want.grad()));
}

TEST(Fsdp, AnEmptyBufferTakesNothingFromThePool) {
  // A middle stage's rest by blocks has no parameters: its gathers and gradient buffers
  // must not take (and keep) the pool's block, which no release would give back.
  storage_pool pool;
  auto t = torch::empty({1000});
  const auto bytes = t.storage().nbytes();
  release_storage(t);
  materialize_storage(t, bytes, &pool);
  release_storage(t, &pool);
  ASSERT_EQ(pool.held(), bytes);
  auto empty = torch::empty({0});
  materialize_storage(empty, 0, &pool);
  EXPECT_EQ(pool.held(), bytes);
  release_storage(empty, &pool);
  EXPECT_EQ(pool.held(), bytes);
}

TEST(Fsdp, ShardedOpsGiveEachRankItsPiecesOfTheSummedGradients) {
  const int R = 2;
  const auto ref = summed_reference("gpt-tiny", 2, R);
  const auto& [spec, init, range, tokens, targets, whole] = ref;
  const auto groups = in_process_groups(R);
  std::vector<torch::Tensor> got(R);
  std::vector<shard_layout> layouts(R);
  std::vector<std::thread> ranks;
  for (int r = 0; r < R; ++r)
    ranks.emplace_back([&, r] {
      auto slice = make_slice(spec, range, init, R, torch::kCPU, torch::kFloat32, {}, {});
      const auto buckets = grad_buckets(slice->entries(), slice->flat_params().numel(), R, 3000);
      layouts[r] = bucket_shard(buckets, R, r);
      auto sh = shard_slice(*slice, buckets, layouts[r], /*params=*/true);
      EXPECT_FALSE(storage_held(slice->flat_params()));
      EXPECT_FALSE(storage_held(slice->flat_grads()));
      gather_params(*slice, sh, sh.rest(), *groups[r]);  // (by chunks: the one unit)
      auto loss = slice->loss(slice->forward(tokens[r]), targets[r]);
      release_params(sh);
      gather_params(*slice, sh, sh.rest(), *groups[r]);  // (by chunks: the one unit)
      make_grads(sh);
      loss.backward();
      release_params(sh);
      reduce_grads(sh, *groups[r]);
      EXPECT_FALSE(storage_held(slice->flat_grads()));
      got[r] = sh.grads;
    });
  for (auto& t : ranks) t.join();
  expect_pieces_of(*whole, layouts, got);
}

namespace {

/// What a stage's hooks do by blocks (actors/stage: fsdp_block_hooks), without prefetch,
/// recording the calls and the block units held at each.
struct recording_hooks final : model_slice::block_hooks {
  model_slice& slice;
  sharded_slice& sh;
  collective_group& group;
  std::vector<std::string> calls;
  std::size_t most_blocks_held = 0;
  recording_hooks(model_slice& s, sharded_slice& h, collective_group& g) : slice(s), sh(h), group(g) {}
  void count() {
    std::size_t held = 0;
    for (std::size_t u = 0; u < sh.rest(); ++u) held += storage_held(sh.units[u].params) ? 1 : 0;
    most_blocks_held = std::max(most_blocks_held, held);
  }
  void before(int block, bool backward) override {
    calls.push_back((backward ? "B" : "F") + std::to_string(block) + "+");
    const auto u = sh.unit_of(block);
    gather_params(slice, sh, u, group);
    if (backward) make_grads(sh, u);
    count();
  }
  void after(int block, bool backward) override {
    calls.push_back((backward ? "B" : "F") + std::to_string(block) + "-");
    const auto u = sh.unit_of(block);
    release_params(sh, u);
    if (backward) reduce_grads(sh, u, group);
  }
};

}  // namespace

TEST(Fsdp, ByBlocksEachBlockIsGatheredForItsForwardAndBackwardAndReducedAsItsBackwardEnds) {
  for (const char* workload : {"gpt-tiny", "llama-tiny"}) {
    SCOPED_TRACE(workload);
    for (const char* recompute : {"none", "full"}) {
      SCOPED_TRACE(recompute);
      const int R = 2;
      const auto ref = summed_reference(workload, 3, R);
      const auto& [spec, init, range, tokens, targets, whole] = ref;
      const auto groups = in_process_groups(R);
      std::vector<torch::Tensor> got(R);
      std::vector<shard_layout> layouts(R);
      std::vector<std::vector<std::string>> calls(R);
      std::vector<std::size_t> most(R), units(R);
      std::vector<int> held_after(R, -1);
      std::vector<std::thread> ranks;
      for (int r = 0; r < R; ++r)
        ranks.emplace_back([&, r] {
          auto slice = make_slice(spec, range, init, R, torch::kCPU, torch::kFloat32, {}, {});
          slice->set_recompute(parse_recompute(recompute));
          const shard_groups g{R, r};
          const auto buckets = slice_buckets(*slice, g, 3000, /*by_blocks=*/true);
          layouts[r] = bucket_shard(buckets, g);
          auto sh = shard_slice(*slice, buckets, layouts[r], /*params=*/true, nullptr, g, /*by_blocks=*/true);
          units[r] = sh.units.size();
          recording_hooks hooks(*slice, sh, *groups[r]);
          gather_params(*slice, sh, sh.rest(), *groups[r]);
          make_grads(sh, sh.rest());
          slice->set_block_hooks(&hooks);
          auto loss = slice->loss(slice->forward(tokens[r]), targets[r]);
          slice->set_block_hooks(nullptr);
          int held = 0;
          for (const auto& u : sh.units) held += storage_held(u.params) ? 1 : 0;
          held_after[r] = held;  // (the rest only)
          loss.backward();
          release_params(sh, sh.rest());
          reduce_grads(sh, sh.rest(), *groups[r]);
          calls[r] = hooks.calls;
          most[r] = hooks.most_blocks_held;
          got[r] = sh.grads;
        });
      for (auto& t : ranks) t.join();
      const std::vector<std::string> order{"F0+", "F0-", "F1+", "F1-", "F2+", "F2-",
                                           "B2+", "B2-", "B1+", "B1-", "B0+", "B0-"};
      for (int r = 0; r < R; ++r) {
        EXPECT_EQ(units[r], 4u) << "three blocks and the rest";
        EXPECT_EQ(calls[r], order) << "rank " << r;
        EXPECT_EQ(most[r], 1u) << "one block's parameters held at a time";
        EXPECT_EQ(held_after[r], 1) << "after the forward only the rest is held";
      }
      expect_pieces_of(*whole, layouts, got);
    }
  }
}

TEST(Fsdp, ByBlocksALaterSlicesBlocksReduceOnlyOnceTheirGradientsAreIn) {
  // A later slice's input is a leaf: its gradient is accumulated as soon as it is ready,
  // maybe before the first block's parameters' are. The hook after that block's backward
  // must still see all of them (each rank's pieces against the unsharded slice's).
  // (gpt2's: its first layer norm's one backward node gives the input's gradient and its
  // weight's and bias's at once.)
  const auto spec = small_spec("gpt-tiny", 4);
  const auto init = initial_state(spec, 3);
  const int R = 2;
  const auto range = partition_layers(spec.decoder.n_layer, 2)[1];
  torch::manual_seed(2);
  const auto input = torch::randn({2, 16, 32});
  const auto target = torch::randint(0, spec.decoder.vocab, {2, 16}, torch::kInt64);
  auto whole = make_slice(spec, range, init, R, torch::kCPU, torch::kFloat32, {}, {});
  for (int r = 0; r < R; ++r)
    whole->loss(whole->forward(input.clone().requires_grad_(true)), target).backward();
  const auto groups = in_process_groups(R);
  std::vector<torch::Tensor> got(R), input_grads(R);
  std::vector<shard_layout> layouts(R);
  std::vector<std::thread> ranks;
  for (int r = 0; r < R; ++r)
    ranks.emplace_back([&, r] {
      auto slice = make_slice(spec, range, init, R, torch::kCPU, torch::kFloat32, {}, {});
      const shard_groups g{R, r};
      const auto buckets = slice_buckets(*slice, g, 0, /*by_blocks=*/true);
      layouts[r] = bucket_shard(buckets, g);
      auto sh = shard_slice(*slice, buckets, layouts[r], /*params=*/true, nullptr, g, /*by_blocks=*/true);
      recording_hooks hooks(*slice, sh, *groups[r]);
      gather_params(*slice, sh, sh.rest(), *groups[r]);
      make_grads(sh, sh.rest());
      slice->set_block_hooks(&hooks);
      const auto x = input.clone().requires_grad_(true);
      auto loss = slice->loss(slice->forward(x), target);
      slice->set_block_hooks(nullptr);
      loss.backward();
      release_params(sh, sh.rest());
      reduce_grads(sh, sh.rest(), *groups[r]);
      got[r] = sh.grads;
      input_grads[r] = x.grad();
    });
  for (auto& t : ranks) t.join();
  expect_pieces_of(*whole, layouts, got);
  for (int r = 0; r < R; ++r) EXPECT_TRUE(input_grads[r].defined());
}

}  // namespace troupe
