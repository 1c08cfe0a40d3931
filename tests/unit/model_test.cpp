#include <gtest/gtest.h>

#include <cmath>

#include "compute/models/model.hpp"
#include "compute/models/partition.hpp"

namespace troupe {

TEST(Model, GptTinyHasGpt2NamesAndShapes) {
  const auto spec = model_spec::gpt_tiny();
  const auto state = initial_state(spec, 1234);
  ASSERT_EQ(state.size(), 2u + 8 * 12 + 2);
  EXPECT_EQ(state[0].first, "wte.weight");
  EXPECT_EQ(state[0].second.sizes(), (std::vector<std::int64_t>{256, 128}));
  EXPECT_EQ(state[1].first, "wpe.weight");
  EXPECT_EQ(state[4].first, "h.0.attn.c_attn.weight");
  EXPECT_EQ(state[4].second.sizes(), (std::vector<std::int64_t>{384, 128}));
  EXPECT_EQ(state.back().first, "ln_f.bias");
  std::int64_t n = 0;
  for (const auto& [name, t] : state) n += t.numel();
  EXPECT_EQ(n, 256 * 128 + 128 * 128 + 8 * (4 * 128 + 384 * 128 + 384 + 128 * 128 + 128 + 512 * 128 + 512 + 128 * 512 + 128) + 2 * 128);
}

TEST(Model, GptInitFollowsWorkloads) {
  const auto state = initial_state(model_spec::gpt_tiny(), 1234);
  std::map<std::string, torch::Tensor> s(state.begin(), state.end());
  EXPECT_NEAR(s["h.0.attn.c_attn.weight"].std().item<double>(), 0.02, 0.001);
  EXPECT_NEAR(s["h.3.mlp.c_proj.weight"].std().item<double>(), 0.02 / std::sqrt(16.0), 0.0005);
  EXPECT_NEAR(s["h.3.attn.c_proj.weight"].std().item<double>(), 0.02 / std::sqrt(16.0), 0.0005);
  EXPECT_EQ(s["h.2.attn.c_attn.bias"].abs().sum().item<double>(), 0.0);
  EXPECT_TRUE(torch::equal(s["ln_f.weight"], torch::ones({128})));
  // Same seed, same weights; another seed, others.
  EXPECT_TRUE(torch::equal(initial_state(model_spec::gpt_tiny(), 1234)[0].second, state[0].second));
  EXPECT_FALSE(torch::equal(initial_state(model_spec::gpt_tiny(), 1)[0].second, state[0].second));
}

TEST(Model, MlpUsesPytorchDefaultLinearInit) {
  const auto state = initial_state(model_spec::fmnist_mlp(), 1234);
  ASSERT_EQ(state.size(), 8u);
  EXPECT_EQ(state[2].first, "net.2.weight");
  const double bound = 1.0 / std::sqrt(784.0);
  EXPECT_LE(state[0].second.abs().max().item<double>(), bound);
  EXPECT_GT(state[0].second.abs().max().item<double>(), 0.99 * bound);
  EXPECT_LE(state[1].second.abs().max().item<double>(), bound);
}

TEST(Model, SlicesOwnEmbeddingsHeadAndATiedCopy) {
  const auto spec = model_spec::gpt_tiny();
  const auto state = initial_state(spec, 1234);
  const auto ranges = partition_layers(8, 2);
  auto first = make_slice(spec, ranges[0], state);
  auto last = make_slice(spec, ranges[1], state);
  EXPECT_NO_THROW(first->param("wpe.weight"));
  EXPECT_THROW(first->param("ln_f.weight"), model_error);
  EXPECT_THROW(first->param("h.4.ln_1.weight"), model_error);
  EXPECT_NO_THROW(last->param("h.4.ln_1.weight"));
  EXPECT_THROW(last->param("wpe.weight"), model_error);
  EXPECT_TRUE(torch::equal(first->param("wte.weight"), last->param("wte.weight")));
  EXPECT_FALSE(first->entries()[0].shared_copy);
  EXPECT_TRUE(last->entries()[0].shared_copy);
  EXPECT_EQ(last->state().size() + 1, last->state(true).size());
}

TEST(Model, ParametersAndGradsAreViewsOfFlatBuffers) {
  const auto spec = model_spec::gpt_tiny();
  auto slice = make_slice(spec, partition_layers(8, 1)[0], initial_state(spec, 1234), /*pad_to=*/3);
  EXPECT_EQ(slice->flat_params().numel() % 3, 0);
  EXPECT_GE(slice->flat_params().numel(), slice->numel());
  auto x = torch::randint(0, 256, {2, 16}, torch::kInt64);
  slice->loss(slice->forward(x), x).backward();
  EXPECT_GT(slice->flat_grads().abs().sum().item<double>(), 0.0);
  const auto& e = slice->entries()[5];
  const auto& p = slice->parameters()[5];
  EXPECT_TRUE(torch::equal(p.grad().reshape({-1}), slice->flat_grads().narrow(0, e.offset, e.numel)));
  // Writing the flat buffer writes the parameter.
  {
    torch::NoGradGuard g;
    slice->flat_params().narrow(0, e.offset, 1).fill_(42.0);
  }
  EXPECT_EQ(p.reshape({-1})[0].item<float>(), 42.0f);
  slice->zero_grads();
  EXPECT_EQ(p.grad().abs().sum().item<double>(), 0.0);
}

TEST(Model, CheckStateNamesWhatIsWrong) {
  const auto spec = model_spec::gpt_tiny();
  auto state = initial_state(spec, 1234);
  state[1].second = torch::zeros({3, 3});
  state.pop_back();
  state.emplace_back("lm_head.weight", torch::zeros({2}));
  try {
    check_state(spec, state);
    FAIL();
  } catch (const model_error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("wpe.weight has shape [3, 3]"), std::string::npos) << msg;
    EXPECT_NE(msg.find("missing ln_f.bias"), std::string::npos) << msg;
    EXPECT_NE(msg.find("unexpected lm_head.weight"), std::string::npos) << msg;
  }
  EXPECT_THROW(check_state(model_spec::fmnist_mlp(), initial_state(spec, 1)), model_error);
}

}  // namespace troupe
