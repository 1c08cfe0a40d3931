// Zero-bubble pipelines (ZB-H1): the backward split into B (the input's gradient) and W
// (the linear layers' weight gradients, run later). B then W gives the plain backward's
// gradients, for gpt (fp32, bf16, with recomputation) and the MLP, and whole jobs end
// with the same parameters as 1f1b in both runtimes.
#include <gtest/gtest.h>

#include "compute/runtime/device.hpp"
#include "compute/models/partition.hpp"
#include "compute/trainer/local_trainer.hpp"
#include "quiet_run.hpp"
#include "test_util.hpp"

namespace troupe {

namespace {

/// The gradients of two slices of `spec` after two micro-batches run as two pipeline
/// stages run them: [the first micro-batch's gradient between the slices, first slice's
/// flat gradients, last slice's]. `split`: each forward defers its weight gradients and
/// every W runs after both backwards (as the last stage of ZB-H1 may run them); the
/// store sizes seen after the backwards go to `deferred`, and `after_b` gets the flat
/// gradients of both slices before any W.
std::vector<torch::Tensor> grads_of(const model_spec& spec, bool split, bool recompute, torch::ScalarType precision,
                                    std::vector<std::size_t>* deferred = nullptr,
                                    std::vector<torch::Tensor>* after_b = nullptr) {
  const auto init = initial_state(spec, 1234);
  const auto ranges = partition_layers(spec.n_layers(), 2);
  auto first = make_slice(spec, ranges[0], init), last = make_slice(spec, ranges[1], init);
  first->set_recompute(recompute);
  last->set_recompute(recompute);
  std::vector<weight_grad_store> stores(4);
  std::vector<torch::Tensor> out;
  const bool gpt = spec.type == model_spec::kind::decoder;
  for (std::uint64_t mb = 0; mb < 2; ++mb) {
    torch::manual_seed(mb);
    const auto input = gpt ? torch::randint(256, {4, spec.decoder.seq_len}, torch::kInt64) : torch::randn({8, 784});
    const auto target = gpt ? torch::randint(256, {4, spec.decoder.seq_len}, torch::kInt64) : torch::randint(10, {8});
    torch::Tensor act, in, loss;
    {
      precision_scope amp(torch::kCPU, precision);
      first->defer_weight_grads(split ? &stores[2 * mb] : nullptr);
      act = first->forward(input);
      in = act.detach().requires_grad_(true);
      last->defer_weight_grads(split ? &stores[2 * mb + 1] : nullptr);
      loss = last->loss(last->forward(in), target);
      first->defer_weight_grads(nullptr);
      last->defer_weight_grads(nullptr);
    }
    loss.backward();
    act.backward(in.grad());
    if (mb == 0) out.push_back(in.grad().clone());
  }
  if (deferred)
    for (const auto& s : stores) deferred->push_back(s.size());
  if (after_b) *after_b = {first->flat_grads().clone(), last->flat_grads().clone()};
  for (auto& s : stores) s.apply();
  for (const auto& s : stores) EXPECT_TRUE(s.empty());
  out.push_back(first->flat_grads().clone());
  out.push_back(last->flat_grads().clone());
  return out;
}

void expect_same_gradients(const model_spec& spec, bool recompute, torch::ScalarType precision, double tolerance) {
  const auto plain = grads_of(spec, false, recompute, precision);
  std::vector<std::size_t> deferred;
  std::vector<torch::Tensor> after_b;
  const auto split = grads_of(spec, true, recompute, precision, &deferred, &after_b);
  const std::string what = spec.name() + (recompute ? " recompute " : " ") + c10::toString(precision);
  // The forwards deferred every linear layer's weight gradient: 4 per transformer block,
  // one per MLP layer; B left those at zero (and computed the rest).
  const std::size_t per_slice = spec.type == model_spec::kind::decoder ? 4 * spec.n_layers() / 2 : 2;
  EXPECT_EQ(deferred, std::vector<std::size_t>(4, per_slice)) << what;
  for (int i = 0; i < 2; ++i) {
    EXPECT_GT(after_b[i].abs().sum().item<double>(), 0.0) << what << ": B computed no gradient";
    EXPECT_GT((split[i + 1] - after_b[i]).abs().sum().item<double>(), 0.0) << what << ": W added nothing";
  }
  ASSERT_EQ(plain.size(), split.size());
  for (std::size_t i = 0; i < plain.size(); ++i) {
    EXPECT_GT(plain[i].abs().sum().item<double>(), 0.0) << i;
    const double diff = (plain[i] - split[i]).abs().max().item<double>();
    EXPECT_LE(diff, tolerance * plain[i].abs().max().item<double>()) << what << ", tensor " << i;
  }
}

}  // namespace

TEST(ZeroBubble, BackwardThenWeightPassGiveThePlainGradients) {
  expect_same_gradients(model_spec::gpt_tiny(), false, torch::kFloat32, 1e-6);
  expect_same_gradients(model_spec::gpt_tiny(), true, torch::kFloat32, 1e-6);
  expect_same_gradients(model_spec::fmnist_mlp(), false, torch::kFloat32, 1e-6);
  // bf16: the same products in bf16, summed in another order: within bf16's rounding.
  expect_same_gradients(model_spec::gpt_tiny(), false, torch::kBFloat16, 1e-2);
}

// Whole jobs: zero-bubble ends where 1f1b ends (the actor runtime with data parallelism,
// recomputation and bf16; the plain loop), and its stages ran exactly its order.
TEST(ZeroBubble, JobsEndWithTheSameParametersAs1F1B) {
  struct layout {
    int p, d;
    const char* precision;
    const char* recompute;
  };
  for (const auto& l : {layout{2, 2, "fp32", "none"}, layout{4, 1, "fp32", "full"}, layout{2, 1, "bf16", "none"}}) {
    auto c = test::small_config(3);
    c.threads = 1;
    c.pipeline = l.p;
    c.data_parallel = l.d;
    c.precision = l.precision;
    c.recompute = l.recompute;
    c.eval_interval = 0;
    const auto one = test::run_quietly(c);
    c.schedule = "zero-bubble";
    const auto zb = test::run_quietly(c);
    ASSERT_EQ(one.exit_code, 0) << one.error;
    ASSERT_EQ(zb.exit_code, 0) << zb.error;
    const std::string what = std::to_string(l.p) + "x" + std::to_string(l.d) + " " + l.precision + " " + l.recompute;
    EXPECT_LE(test::max_abs_diff(zb.final_state, one.final_state), std::string(l.precision) == "bf16" ? 1e-3 : 1e-6)
        << what;
    ASSERT_EQ(zb.losses.size(), one.losses.size());
    for (std::size_t i = 0; i < one.losses.size(); ++i)
      EXPECT_NEAR(zb.losses[i], one.losses[i], std::string(l.precision) == "bf16" ? 1e-3 : 1e-6) << what;
    // Each stage ran W ops, and held at most p micro-batches (1f1b's stage 0 holds p).
    int w_ops = 0;
    for (const auto& e : zb.events) w_ops += e.name == "W";
    EXPECT_EQ(w_ops, c.steps * l.d * l.p * c.microbatches) << what;
  }
  auto c = test::gpt_config(3);
  c.threads = 1;
  c.runtime = "local";
  c.pipeline = 2;
  local_trainer one(c);
  c.schedule = "zb-h1";
  local_trainer zb(c);
  for (int i = 0; i < 3; ++i) EXPECT_NEAR(zb.step().loss, one.step().loss, 1e-6);
  EXPECT_LE(test::max_abs_diff(zb.state(), one.state()), 1e-6);
}

}  // namespace troupe
