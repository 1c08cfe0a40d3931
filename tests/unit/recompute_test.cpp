// Activation recomputation (`train.recompute`): full: each transformer block keeps only its
// input for the backward and runs again there; selective: the attention core keeps only q,
// k and v. The gradients are bit-identical to those without it (fp32 and bf16), whole jobs
// end with the same parameters in both runtimes and every schedule, and a micro-batch
// waiting for its backward holds less memory.
#include <gtest/gtest.h>
#include <torch/version.h>

#include "compute/runtime/device.hpp"
#include "compute/models/partition.hpp"
#include "compute/trainer/local_trainer.hpp"
#include "held_bytes.hpp"
#include "quiet_run.hpp"
#include "test_util.hpp"

namespace troupe {

namespace {

struct micro_batch {
  torch::Tensor input, target;
};

micro_batch tokens(std::int64_t b, std::int64_t t, std::uint64_t seed) {
  torch::manual_seed(seed);
  return {torch::randint(256, {b, t}, torch::kInt64), torch::randint(256, {b, t}, torch::kInt64)};
}

/// gpt-tiny as two slices (layers 0-3 and 4-7, as two pipeline stages hold them); two
/// micro-batches forward and backward as stages run them (the second slice's input a
/// fresh leaf whose gradient goes back). Returns the flat gradients of both slices and
/// the gradient of the first micro-batch's activation between them.
std::vector<torch::Tensor> grads_of(recompute_mode recompute, torch::ScalarType precision) {
  const auto spec = model_spec::gpt_tiny();
  const auto init = initial_state(spec, 1234);
  const auto ranges = partition_layers(spec.n_layers(), 2);
  auto first = make_slice(spec, ranges[0], init), last = make_slice(spec, ranges[1], init);
  first->set_recompute(recompute);
  last->set_recompute(recompute);
  std::vector<torch::Tensor> out;
  for (std::uint64_t mb = 0; mb < 2; ++mb) {
    const auto data = tokens(4, 128, mb);
    torch::Tensor act, in, loss;
    {
      precision_scope amp(torch::kCPU, precision);
      act = first->forward(data.input);
      in = act.detach().requires_grad_(true);
      loss = last->loss(last->forward(in), data.target);
    }
    loss.backward();  // outside the scope, as stages run their backwards
    act.backward(in.grad());
    if (mb == 0) out.push_back(in.grad().clone());
  }
  out.push_back(first->flat_grads().clone());
  out.push_back(last->flat_grads().clone());
  return out;
}

}  // namespace

TEST(Recompute, GradientsAreBitIdenticalInFp32AndBf16) {
  for (const auto precision : {torch::kFloat32, torch::kBFloat16}) {
    const auto plain = grads_of(recompute_mode::none, precision);
    for (const auto mode : {recompute_mode::full, recompute_mode::selective}) {
      const auto blocks = model_slice::blocks_recomputed(), attentions = model_slice::attentions_recomputed();
      const auto recomputed = grads_of(mode, precision);
      // 8 blocks, two micro-batches: each block or attention core once per backward.
      EXPECT_EQ(model_slice::blocks_recomputed() - blocks, mode == recompute_mode::full ? 16 : 0);
      EXPECT_EQ(model_slice::attentions_recomputed() - attentions, mode == recompute_mode::selective ? 16 : 0);
      ASSERT_EQ(plain.size(), recomputed.size());
      for (std::size_t i = 0; i < plain.size(); ++i) {
        EXPECT_GT(plain[i].abs().sum().item<double>(), 0.0) << i;
        EXPECT_TRUE(torch::equal(plain[i], recomputed[i]))
            << (mode == recompute_mode::full ? "full" : "selective") << ", tensor " << i << " ("
            << c10::toString(precision) << "): max difference " << (plain[i] - recomputed[i]).abs().max().item<double>();
      }
    }
  }
}

// After the forward of one micro-batch (mbs 4, all 8 blocks, its loss), the graph holds
// each block's input and the head's activations with full recomputation, and every
// block's intermediates (attention scores and probabilities, the MLP's 4x-wide
// activations...) without it. Selective recomputation keeps everything but the attention
// core's: with LibTorch 1.13's explicit attention at least the softmax's probabilities
// (B x H x T x T per block) less; LibTorch 2.x's fused attention keeps no such matrix, so
// there it saves little.
TEST(Recompute, KeepsOnlyEachBlocksInputForTheBackward) {
  const auto spec = model_spec::gpt_tiny();
  const auto init = initial_state(spec, 1234);
  const auto data = tokens(4, 128, 7);
  auto held = [&](recompute_mode recompute) {
    auto slice = make_slice(spec, partition_layers(spec.n_layers(), 1)[0], init);
    slice->set_recompute(recompute);
    return test::bytes_held_for_backward(*slice, data.input, data.target);
  };
  held(recompute_mode::none);  // first use: one-off buffers (thread pools, BLAS) outside the measure
  const auto plain = held(recompute_mode::none), recomputed = held(recompute_mode::full);
  const auto selective = held(recompute_mode::selective);
  const std::int64_t probabilities = 8 * 4 * 4 * 128 * 128 * 4;  // 8 blocks x (4, 4 heads, 128, 128) fp32
  std::cout << "held after the forward with selective recompute: " << selective << " bytes (attention "
            << "probabilities: " << probabilities << ")\n";
  EXPECT_LT(selective, plain);
  EXPECT_GT(selective, recomputed);
#if TORCH_VERSION_MAJOR < 2
  EXPECT_LE(selective + probabilities, plain) << "the attention core's probabilities are still held";
#endif
  const std::int64_t block_inputs = 8 * 4 * 128 * 128 * 4;  // 8 blocks x (4, 128, 128) fp32
  std::cout << "held after the forward: " << plain << " bytes without recompute, " << recomputed
            << " with (block inputs: " << block_inputs << ")\n";
  EXPECT_GE(recomputed, block_inputs) << "the measure sees the saved inputs";
  EXPECT_LT(recomputed * 4, plain) << "recomputation keeps less than a quarter";
}

// Whole jobs: recomputation changes nothing in the result, in the actor runtime (fixed
// schedules, interleaved chunks, dataflow, bf16) and in the plain loop.
TEST(Recompute, JobsEndWithTheSameParameters) {
  struct layout {
    int p, d, v;
    const char* schedule;
    const char* precision;
  };
  for (const auto& l : {layout{2, 2, 1, "1f1b", "fp32"}, layout{2, 1, 2, "interleaved-1f1b", "fp32"},
                        layout{2, 1, 1, "dataflow", "fp32"}, layout{2, 1, 1, "1f1b", "bf16"}}) {
    auto c = test::small_config(2);
    c.threads = 1;
    c.pipeline = l.p;
    c.data_parallel = l.d;
    c.chunks = l.v;
    c.schedule = l.schedule;
    c.precision = l.precision;
    c.eval_interval = 0;
    const auto plain = test::run_quietly(c);
    c.recompute = "full";
    const auto before = model_slice::blocks_recomputed();
    const auto recomputed = test::run_quietly(c);
    c.recompute = "selective";
    const auto attentions = model_slice::attentions_recomputed();
    const auto selective = test::run_quietly(c);
    EXPECT_EQ(model_slice::attentions_recomputed() - attentions,
              std::int64_t(c.steps) * c.data_parallel * c.microbatches * c.model().n_layers())
        << l.schedule;
    ASSERT_EQ(selective.exit_code, 0) << selective.error;
    EXPECT_EQ(test::max_abs_diff(selective.final_state, plain.final_state), 0.0) << l.schedule << " " << l.precision;
    EXPECT_EQ(selective.losses, plain.losses) << l.schedule << " " << l.precision;
    // Every block, every micro-batch of every replica, every step (the validation runs
    // without a graph: nothing to recompute).
    EXPECT_EQ(model_slice::blocks_recomputed() - before,
              std::int64_t(c.steps) * c.data_parallel * c.microbatches * c.model().n_layers())
        << l.schedule;
    ASSERT_EQ(plain.exit_code, 0) << plain.error;
    ASSERT_EQ(recomputed.exit_code, 0) << recomputed.error;
    EXPECT_EQ(test::max_abs_diff(recomputed.final_state, plain.final_state), 0.0) << l.schedule << " " << l.precision;
    EXPECT_EQ(recomputed.losses, plain.losses) << l.schedule << " " << l.precision;
  }
  auto c = test::gpt_config(2);
  c.threads = 1;
  c.runtime = "local";
  c.pipeline = 2;
  local_trainer plain(c);
  c.recompute = "full";
  local_trainer recomputed(c);
  const auto before = model_slice::blocks_recomputed();
  for (int i = 0; i < 2; ++i) EXPECT_EQ(recomputed.step().loss, plain.step().loss) << "step " << i;
  EXPECT_EQ(model_slice::blocks_recomputed() - before, 2 * c.microbatches * c.model().n_layers());
  EXPECT_EQ(test::max_abs_diff(recomputed.state(), plain.state()), 0.0);
  c.recompute = "selective";
  local_trainer selective(c);
  for (int i = 0; i < 2; ++i) selective.step();
  EXPECT_EQ(test::max_abs_diff(selective.state(), plain.state()), 0.0);
}

}  // namespace troupe
