// Tensor and sequence parallelism (compute/parallel/tensor_parallel.hpp): each parallel layer
// against its unsplit counterpart. The local loop split over T ranks:
// tensor_parallel_{training,checkpoint,config,evaluation,over_ucx}_test.cpp.
#include <gtest/gtest.h>

#include <thread>

#include <torch/nn/functional.h>

#include "actors/tp_groups.hpp"
#include "rank_threads.hpp"
#include "ucx_groups.hpp"
#include "compute/parallel/tensor_parallel.hpp"
#include "compute/models/tensor_parallel_layout.hpp"
#include "compute/trainer/local_trainer.hpp"
#include "test_util.hpp"
#include "tp_test_util.hpp"

namespace troupe {

namespace {

namespace F = torch::nn::functional;
using namespace tp_test;

/// Runs fn(rank, group) on `size` threads, one per rank of an in-process group.
void on_ranks(int size, const std::function<void(int, collective_group&)>& fn) {
  test::on_group_ranks(size, [&](int rank, std::shared_ptr<collective_group> g) { fn(rank, *g); });
}

torch::Tensor leaf(const torch::Tensor& t) { return t.detach().clone().requires_grad_(true); }

}  // namespace

TEST(TensorParallelLayers, PartsPutBackTogetherAsTheWholeParameter) {
  auto llama = model_spec::llama_tiny();
  llama.decoder.n_kv_head = 4;
  for (const auto& spec : {model_spec::gpt_tiny(), llama})
    for (int size : {2, 4}) {
      for (const auto& [name, full] : initial_state(spec, 7)) {
        std::vector<torch::Tensor> parts;
        for (int t = 0; t < size; ++t) parts.push_back(shard_parameter(spec, name, full, size, t));
        EXPECT_TRUE(torch::equal(unshard_parameter(spec, name, parts), full)) << name << " over " << size;
        if (tp_split_of(spec, name) != tp_split::replicated)
          EXPECT_EQ(parts[1].numel() * size, full.numel()) << name;
      }
    }
  // gpt2's fused c_attn: rank 1 of 2 holds the second half of q's rows, then of k's, then of v's.
  const auto spec = model_spec::gpt_tiny();
  const auto w = torch::arange(3 * 128 * 2, torch::kFloat32).view({3 * 128, 2});
  const auto part = shard_parameter(spec, "h.0.attn.c_attn.weight", w, 2, 1);
  EXPECT_TRUE(torch::equal(part, torch::cat({w.slice(0, 64, 128), w.slice(0, 192, 256), w.slice(0, 320, 384)})));
  EXPECT_EQ(tp_split_of(spec, "h.0.attn.c_proj.weight"), tp_split::columns);
  EXPECT_EQ(tp_split_of(spec, "h.0.attn.c_proj.bias"), tp_split::replicated);
  EXPECT_EQ(tp_split_of(spec, "wpe.weight"), tp_split::replicated);
  EXPECT_EQ(tp_split_of(llama, "model.layers.3.mlp.down_proj.weight"), tp_split::columns);
  EXPECT_EQ(tp_split_of(llama, "model.layers.3.self_attn.k_proj.weight"), tp_split::rows);
}

TEST(TensorParallelLayers, FAndGAndTheSequenceCollectivesHaveMegatronsGradients) {
  const int size = 4;
  torch::manual_seed(3);
  const auto x = torch::randn({size, 2, 8, 3});       // per rank (batch 2, sequence 8, features 3)
  const auto w = torch::randn({size, 2, 8 * size, 3});  // per rank: the upstream gradient's weights
  const auto sum_w = w.sum(0);
  on_ranks(size, [&](int t, collective_group& g) {
    const auto mine = x[t], weight = w[t];
    // f: identity forward; the backward sums every rank's gradient.
    auto a = leaf(mine);
    auto y = tp::copy_to(a, g);
    EXPECT_TRUE(torch::equal(y, mine));
    (y * weight.narrow(1, 0, 8)).sum().backward();
    EXPECT_LT(diff(a.grad(), sum_w.narrow(1, 0, 8)), 1e-6);
    // g: the sum forward, identity backward.
    auto b = leaf(mine);
    y = tp::reduce_from(b, g);
    EXPECT_LT(diff(y, x.sum(0)), 1e-6);
    (y * weight.narrow(1, 0, 8)).sum().backward();
    EXPECT_TRUE(torch::equal(b.grad(), weight.narrow(1, 0, 8)));
    // Entering a column-parallel layer: gather forward, reduce-scatter backward.
    auto c = leaf(mine);
    y = tp::gather_sequence(c, g, /*reduce_grad=*/true);
    EXPECT_TRUE(torch::equal(y, torch::cat(x.unbind(0), 1)));
    (y * weight).sum().backward();
    EXPECT_LT(diff(c.grad(), sum_w.narrow(1, 8 * t, 8)), 1e-6);
    // Leaving a stage: gather forward, this rank's positions of a gradient all hold.
    auto d = leaf(mine);
    (tp::gather_sequence(d, g, /*reduce_grad=*/false) * w[0]).sum().backward();
    EXPECT_TRUE(torch::equal(d.grad(), w[0].narrow(1, 8 * t, 8)));
    // Leaving a row-parallel layer: reduce-scatter forward, gather backward.
    auto e = leaf(torch::cat({mine, mine * 2, mine * 3, mine * 4}, 1));  // (2, 32, 3)
    y = tp::reduce_scatter_sequence(e, g);
    const auto whole = torch::cat({x.sum(0), x.sum(0) * 2, x.sum(0) * 3, x.sum(0) * 4}, 1);
    EXPECT_LT(diff(y, whole.narrow(1, 8 * t, 8)), 1e-5);
    (y * weight.narrow(1, 0, 8)).sum().backward();
    EXPECT_TRUE(torch::equal(e.grad(), torch::cat(w.narrow(2, 0, 8).unbind(0), 1)));
    // Entering a stage: this rank's positions forward, gather backward.
    auto f = leaf(w[0]);
    y = tp::scatter_sequence(f, g);
    EXPECT_TRUE(torch::equal(y, w[0].narrow(1, 8 * t, 8)));
    (y * weight.narrow(1, 0, 8)).sum().backward();
    EXPECT_TRUE(torch::equal(f.grad(), torch::cat(w.narrow(2, 0, 8).unbind(0), 1)));
  });
}

TEST(TensorParallelLayers, VocabParallelEmbeddingAndCrossEntropyEqualTheWholeOnes) {
  torch::manual_seed(5);
  const std::int64_t V = 12, N = 10, used = 9;  // 3 padded columns: rank 3 of 4 holds only padding
  const auto weight = torch::randn({V, 4});
  const auto ids = torch::randint(0, used, {2, 5});
  const auto logits = torch::randn({N, V});
  const auto target = torch::randint(0, used, {N});
  const auto padded = torch::arange(V) >= used;
  const auto inf = -std::numeric_limits<float>::infinity();
  // The whole ones.
  auto w = leaf(weight);
  auto e = torch::embedding(w, ids);
  (e * e).sum().backward();
  auto l = leaf(logits);
  auto loss = F::cross_entropy(l.masked_fill(padded, inf), target);
  loss.backward();
  for (int size : {2, 4}) {
    std::vector<torch::Tensor> w_grads(static_cast<std::size_t>(size)), l_grads(static_cast<std::size_t>(size));
    on_ranks(size, [&](int t, collective_group& g) {
      const std::int64_t width = V / size, first = width * t;
      auto wt = leaf(weight.narrow(0, first, width));
      auto et = tp::reduce_from(tp::vocab_embedding(ids, wt, first), g);
      EXPECT_LT(diff(et, e), 1e-6);
      (et * et).sum().backward();
      w_grads[std::size_t(t)] = wt.grad();
      auto lt = leaf(logits.narrow(1, first, width));
      auto part = tp::vocab_cross_entropy(lt.masked_fill(padded.narrow(0, first, width), inf), target, first, g);
      EXPECT_LT(std::abs(part.item<double>() - loss.item<double>()), 1e-6) << "rank " << t << " of " << size;
      part.backward();
      l_grads[std::size_t(t)] = lt.grad();
    });
    EXPECT_LT(diff(torch::cat(w_grads), w.grad()), 1e-6) << size;
    EXPECT_LT(diff(torch::cat(l_grads, 1), l.grad()), 1e-7) << size;
  }
}

}  // namespace troupe
