// Evaluation of a tensor-parallel model equals the unsplit one's.
#include <gtest/gtest.h>

#include <thread>

#include <torch/nn/functional.h>

#include "actors/tp_groups.hpp"
#include "ucx_groups.hpp"
#include "compute/parallel/tensor_parallel.hpp"
#include "compute/models/tensor_parallel_layout.hpp"
#include "compute/trainer/local_trainer.hpp"
#include "test_util.hpp"
#include "tp_test_util.hpp"


namespace troupe {

using namespace tp_test;

TEST(TensorParallelEvaluation, ValidationLossAndLogitsEqualTheUnsplitModels) {
  auto one = small_job("llama-tiny");
  auto two = one;
  two.tensor_parallel = 2;
  two.sequence_parallel = true;
  local_trainer a(one), b(two, std::nullopt, in_process_groups);
  for (int i = 0; i < 3; ++i) {
    a.step();
    b.step();
  }
  const auto ea = a.evaluate(), eb = b.evaluate();
  EXPECT_NEAR(ea.loss, eb.loss, 1e-5);
  EXPECT_NEAR(ea.bits_per_byte(), eb.bits_per_byte(), 1e-5);
  // The logits, gathered over the vocabulary, on each rank.
  const auto tokens = torch::randint(0, 256, {2, 32});
  torch::NoGradGuard no_grad;
  auto& whole = a.replica(0).slice(0);
  const auto want = whole.logits(whole.forward(tokens));
  std::vector<torch::Tensor> got(2);
  std::vector<std::thread> ranks;
  for (int t = 0; t < 2; ++t)
    ranks.emplace_back([&, t] {
      auto& part = b.replica(0, t).slice(0);
      got[std::size_t(t)] = part.logits(part.forward(tokens));
    });
  for (auto& r : ranks) r.join();
  for (const auto& g : got) EXPECT_LT(diff(g, want), 1e-5);
}

}  // namespace troupe
