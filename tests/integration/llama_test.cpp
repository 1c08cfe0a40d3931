// llama-tiny (WORKLOADS.md section 3) goes where gpt-tiny goes: every schedule kind of the
// actor runtime equals the plain loop, recompute modes change no bit, bf16 runs, a
// checkpoint folder resumes in another layout, a failed step is retried in place,
// evaluation runs in the pipeline, and generation with the key/value cache (rotary
// positions, grouped key/value heads) equals generation without it. Against plain
// PyTorch: tests/unit/pytorch_reference_test.cpp (PytorchReference) and
// tests/integration/multiprocess_llama_test.cpp (MultiProcessLlama). Every schedule
// kind against the reference loop: llama_layouts_test.cpp.
#include <gtest/gtest.h>

#include <fstream>

#include <nlohmann/json.hpp>

#include "actor_test_util.hpp"
#include "cached_forward.hpp"
#include "compute/trainer/generate.hpp"
#include "compute/checkpoint/hf_folder.hpp"
#include "compute/models/partition.hpp"
#include "quiet_run.hpp"

namespace troupe {

using namespace actor_test;

namespace {

/// A small llama (2 layers, 4 heads sharing 2 key/value heads, context 24) trained for
/// 100 steps: its next-byte distributions are far from uniform.
job_config small_llama() {
  auto c = llama_config(100);
  c.layers = 2;
  c.d_model = 32;
  c.seq_len = 24;
  c.lr = 3e-3;
  c.min_lr = 3e-4;
  c.eval_interval = 0;
  c.runtime = "local";
  c.validate();
  return c;
}

const state_dict& small_trained() {
  static const state_dict state = [] {
    local_trainer t(small_llama());
    while (t.next_step() < t.config().steps) t.step();
    return t.state();
  }();
  return state;
}

}  // namespace

TEST(Llama, ParametersHaveHuggingFaceNamesAndShapes) {
  const auto spec = model_spec::llama_tiny();  // the workload's own shape
  const auto names = parameter_names(spec);
  ASSERT_EQ(names.size(), 1 + 8 * 9 + 2u);
  EXPECT_EQ(names.front(), "model.embed_tokens.weight");
  EXPECT_EQ(names[1], "model.layers.0.input_layernorm.weight");
  EXPECT_EQ(names[names.size() - 2], "model.norm.weight");
  EXPECT_EQ(names.back(), "lm_head.weight");
  const auto state = initial_state(spec, 1234);
  std::map<std::string, torch::Tensor> by_name(state.begin(), state.end());
  using shape = std::vector<std::int64_t>;
  EXPECT_EQ(by_name.at("model.layers.3.self_attn.q_proj.weight").sizes().vec(), (shape{128, 128}));
  EXPECT_EQ(by_name.at("model.layers.3.self_attn.k_proj.weight").sizes().vec(), (shape{64, 128}));
  EXPECT_EQ(by_name.at("model.layers.3.self_attn.v_proj.weight").sizes().vec(), (shape{64, 128}));
  EXPECT_EQ(by_name.at("model.layers.3.self_attn.o_proj.weight").sizes().vec(), (shape{128, 128}));
  EXPECT_EQ(by_name.at("model.layers.3.mlp.gate_proj.weight").sizes().vec(), (shape{384, 128}));
  EXPECT_EQ(by_name.at("model.layers.3.mlp.down_proj.weight").sizes().vec(), (shape{128, 384}));
  EXPECT_EQ(by_name.at("lm_head.weight").sizes().vec(), (shape{256, 128}));
  // Init: projections normal(0, 0.02), o_proj and down_proj 0.02 / sqrt(16), norms 1.
  EXPECT_NEAR(by_name.at("model.layers.0.mlp.up_proj.weight").std().item<double>(), 0.02, 0.001);
  EXPECT_NEAR(by_name.at("model.layers.0.mlp.down_proj.weight").std().item<double>(), 0.005, 0.0003);
  EXPECT_TRUE(torch::equal(by_name.at("model.norm.weight"), torch::ones({128})));
  EXPECT_EQ(tied_parameter(spec), "");  // untied: no copy of the embedding on the last stage
  // A last pipeline stage holds the final norm and lm_head, no embedding.
  const auto last = partition_layers(8, 2)[1];
  const auto last_names = slice_parameter_names(spec, last);
  EXPECT_EQ(std::count(last_names.begin(), last_names.end(), "model.embed_tokens.weight"), 0);
  EXPECT_EQ(last_names.back(), "lm_head.weight");
}

// Recompute modes change no bit, in fp32 and bf16; a bf16 run follows the fp32 one.
TEST(Llama, RecomputeAndBf16) {
  auto c = llama_config(3);
  c.threads = 1;
  c.pipeline = 2;
  c.data_parallel = 2;
  c.microbatches = 2;
  c.eval_interval = 0;
  std::vector<double> fp32_losses;
  for (const char* precision : {"fp32", "bf16"}) {
    c.precision = precision;
    c.recompute = "none";
    const auto plain = test::run_quietly(c);
    ASSERT_EQ(plain.exit_code, 0) << plain.error;
    for (const char* mode : {"selective", "full"}) {
      c.recompute = mode;
      const auto recomputed = test::run_quietly(c);
      ASSERT_EQ(recomputed.exit_code, 0) << recomputed.error;
      EXPECT_EQ(test::max_abs_diff(recomputed.final_state, plain.final_state), 0.0) << precision << " " << mode;
      EXPECT_EQ(recomputed.losses, plain.losses) << precision << " " << mode;
    }
    if (std::string(precision) == "fp32") fp32_losses = plain.losses;
    else
      for (std::size_t i = 0; i < plain.losses.size(); ++i)
        EXPECT_NEAR(plain.losses[i], fp32_losses[i], 0.03) << "bf16 step " << i;
  }
}

// A checkpoint folder written by p2 x d2 resumes as p4 x d1 and ends where an unbroken
// p4 run ends; an injected failure is retried in place and changes no bit.
TEST(Llama, ResumeInAnotherLayoutAndRetryInPlace) {
  test::temp_dir dir;
  auto c = llama_config(6);
  c.threads = 1;
  c.eval_interval = 0;
  c.pipeline = 4;
  c.microbatches = 4;
  const auto straight = test::run_quietly(c);
  ASSERT_EQ(straight.exit_code, 0) << straight.error;

  auto first = c;
  first.pipeline = 2;
  first.data_parallel = 2;
  first.microbatches = 2;
  first.steps = 6;
  first.checkpoint_dir = dir / "ck";
  first.checkpoint_interval = 3;
  first.throw_at = "1:1:4";  // replica 1's last stage throws in step 4: retried in place
  const auto broken = test::run_quietly(first);
  ASSERT_EQ(broken.exit_code, 0) << broken.error;
  EXPECT_LE(test::max_abs_diff(broken.final_state, straight.final_state), 1e-5);

  auto resumed = c;
  resumed.resume = dir / "ck/step-00000003";
  const auto second = test::run_quietly(resumed);
  ASSERT_EQ(second.exit_code, 0) << second.error;
  EXPECT_LE(test::max_abs_diff(second.final_state, straight.final_state), 1e-5);
}

// Evaluation in the pipeline (the validation windows forward through the stages, split
// between the replicas) equals the plain loop's.
TEST(Llama, PipelineEvaluationEqualsThePlainLoop) {
  auto c = llama_config(2);
  c.threads = 1;
  c.eval_interval = 0;
  c.pipeline = 2;
  c.data_parallel = 2;
  c.microbatches = 2;
  const auto run = test::run_quietly(c);
  ASSERT_EQ(run.exit_code, 0) << run.error;
  ASSERT_EQ(run.evaluations.size(), 1u);
  auto local = c;
  local.runtime = "local";
  local.pipeline = local.data_parallel = 1;
  local_trainer t(local);
  while (t.next_step() < local.steps) t.step();
  EXPECT_NEAR(run.evaluations[0].loss, t.evaluate().loss, 1e-5);
}

// The cache holds the rotated keys of the grouped key/value heads: a forward in pieces
// with it equals the full forward, through the whole model and through two slices.
TEST(Llama, CachedForwardEqualsTheFullForward) {
  test::expect_cached_forward_equals_full(small_llama().model(), small_trained());
}

TEST(Llama, GenerationWithTheCacheEqualsGenerationWithout) {
  const auto spec = small_llama().model();
  sampling_options s;
  s.temperature = 0;
  s.tokens = 40;  // within the context, then past it
  const auto cached = generate(spec, small_trained(), "The ", s);
  s.kv_cache = false;
  EXPECT_EQ(generate(spec, small_trained(), "The ", s), cached);
  EXPECT_EQ(cached.size(), 44u);
  s.temperature = 0.8;  // sampled: the same stream of bytes too
  s.seed = 5;
  const auto sampled = generate(spec, small_trained(), "The ", s);
  s.kv_cache = true;
  EXPECT_EQ(generate(spec, small_trained(), "The ", s), sampled);
}

}  // namespace troupe
