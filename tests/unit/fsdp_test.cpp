// compute/optim/fsdp.hpp: a released storage refilled before the backward serves the
// saved tensors that view it; a slice's ops over an in-process group of ranks give the
// gradients of the whole batch, summed over the ranks, in each rank's pieces.
#include <gtest/gtest.h>

#include <thread>

#include "actors/tp_groups.hpp"
#include "compute/config/job_config.hpp"
#include "compute/models/model.hpp"
#include "compute/models/partition.hpp"
#include "compute/models/parameters.hpp"
#include "compute/optim/fsdp.hpp"
#include "compute/optim/grad_buffer.hpp"
#include "test_util.hpp"

namespace troupe {

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

TEST(Fsdp, ShardedOpsGiveEachRankItsPiecesOfTheSummedGradients) {
  auto cfg = job_config::defaults_for("gpt-tiny");
  cfg.layers = 2;
  cfg.d_model = 32;
  cfg.heads = 2;
  cfg.seq_len = 16;
  const auto spec = cfg.model();
  const auto init = initial_state(spec, 3);
  const int R = 2;
  const auto range = partition_layers(spec.decoder.n_layer, 1)[0];
  torch::manual_seed(1);
  std::vector<torch::Tensor> tokens, targets;
  for (int r = 0; r < R; ++r) {
    tokens.push_back(torch::randint(0, spec.decoder.vocab, {2, 16}, torch::kInt64));
    targets.push_back(torch::randint(0, spec.decoder.vocab, {2, 16}, torch::kInt64));
  }
  // The reference: one slice, both ranks' batches' gradients summed.
  auto whole = make_slice(spec, range, init, R, torch::kCPU, torch::kFloat32, {}, {});
  for (int r = 0; r < R; ++r) whole->loss(whole->forward(tokens[r]), targets[r]).backward();
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
      gather_params(*slice, sh, *groups[r]);
      auto loss = slice->loss(slice->forward(tokens[r]), targets[r]);
      release_params(*slice, sh);
      gather_params(*slice, sh, *groups[r]);
      make_grads(*slice, sh);
      loss.backward();
      release_params(*slice, sh);
      reduce_grads(*slice, sh, *groups[r]);
      EXPECT_FALSE(storage_held(slice->flat_grads()));
      got[r] = sh.grads;
    });
  for (auto& t : ranks) t.join();
  for (int r = 0; r < R; ++r) {
    std::vector<torch::Tensor> mine;
    for (const auto& piece : layouts[r]) mine.push_back(whole->flat_grads().narrow(0, piece.begin, piece.size()));
    EXPECT_LE((got[r] - torch::cat(mine)).abs().max().item<double>(), 1e-6) << "rank " << r;
  }
}

}  // namespace troupe
