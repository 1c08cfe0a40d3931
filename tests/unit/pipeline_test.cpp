// Equivalence (WORKLOADS.md): sliced, micro-batched, data-parallel and sharded runs equal
// the single-process full-batch run; and the C++ loop follows plain PyTorch step for step.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <fstream>
#include <thread>

#include "compute/checkpoint.hpp"
#include "compute/trainer.hpp"
#include "held_bytes.hpp"
#include "test_util.hpp"

namespace troupe {

namespace {

constexpr int kSteps = 10;

state_dict train(job_config cfg, int steps, std::vector<double>* losses = nullptr) {
  local_trainer t(cfg);
  for (int i = 0; i < steps; ++i) {
    auto st = t.step();
    if (losses) losses->push_back(st.loss);
  }
  return t.state();
}

/// The unsliced model on the full batch: one stage, one micro-batch, one replica
/// (computed once per build: test::shared_reference).
const state_dict& reference() {
  static const state_dict ref = test::shared_reference("full-batch-gpt-tiny", [](std::vector<double>* losses) {
    auto c = test::gpt_config(200);
    c.microbatches = 1;
    return train(c, kSteps, losses);
  });
  return ref;
}

struct layout {
  int p, d, m, v;
  const char* schedule;
};

std::string name_of(const layout& l) {
  std::string kind = std::string(l.schedule) == "interleaved-1f1b" ? "interleaved" : l.schedule;
  std::replace(kind.begin(), kind.end(), '-', '_');
  return "p" + std::to_string(l.p) + "_d" + std::to_string(l.d) + "_m" + std::to_string(l.m) + "_v" +
         std::to_string(l.v) + "_" + kind;
}

void PrintTo(const layout& l, std::ostream* os) { *os << name_of(l); }

class Equivalence : public ::testing::TestWithParam<layout> {};

}  // namespace

TEST_P(Equivalence, ParametersEqualTheFullBatchRunAfterTenSteps) {
  const auto l = GetParam();
  auto c = test::gpt_config(200);
  c.pipeline = l.p;
  c.data_parallel = l.d;
  c.microbatches = l.m;
  c.chunks = l.v;
  c.schedule = l.schedule;
  const auto got = train(c, kSteps);
  const double diff = test::max_abs_diff(got, reference());
  EXPECT_LE(diff, 1e-5) << name_of(l);
  EXPECT_GT(test::max_abs_diff(got, initial_state(c.model(), c.seed)), 1e-3) << "parameters did not move";
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, Equivalence,
    // One layout per schedule kind and dimension: micro-batches alone, a deep pipeline,
    // replicas alone and with a pipeline. The V kinds put the tied embedding's two
    // copies on one stage; dualpipev splits some backwards and not others.
    ::testing::Values(layout{1, 1, 8, 1, "1f1b"}, layout{4, 1, 8, 1, "1f1b"}, layout{4, 1, 4, 1, "gpipe"},
                      layout{2, 1, 4, 2, "interleaved-1f1b"}, layout{1, 4, 2, 1, "1f1b"}, layout{2, 2, 4, 1, "1f1b"},
                      layout{4, 1, 8, 1, "zero-bubble"}, layout{1, 1, 4, 1, "combined-1f1b"},
                      layout{2, 2, 4, 2, "combined-1f1b"}, layout{2, 1, 4, 2, "zbv"}, layout{2, 1, 4, 2, "dualpipev"}),
    [](const auto& info) { return name_of(info.param); });

TEST(Equivalence, TiedEmbeddingStaysTiedAcrossStages) {
  auto c = test::gpt_config(200);
  c.pipeline = 4;
  local_trainer t(c);
  for (int i = 0; i < 3; ++i) t.step();
  auto& pipe = t.replica(0);
  EXPECT_TRUE(torch::equal(pipe.slice(0).param("wte.weight"), pipe.slice(3).param("wte.weight")));
  EXPECT_FALSE(torch::equal(pipe.slice(0).param("wte.weight"), initial_state(c.model(), c.seed)[0].second));
}

TEST(Equivalence, ReplicasHoldIdenticalParameters) {
  auto c = test::gpt_config(200);
  c.data_parallel = 2;
  c.microbatches = 2;
  local_trainer t(c);
  t.step();
  t.step();
  EXPECT_TRUE(torch::equal(t.replica(0).slice(0).flat_params(), t.replica(1).slice(0).flat_params()));
}

TEST(Equivalence, ResumeFromCheckpointIsBitIdentical) {
  test::temp_dir dir;
  auto c = test::gpt_config(6);
  c.pipeline = 2;
  c.microbatches = 4;
  const auto straight = train(c, 6);
  {
    local_trainer first(c);
    for (int i = 0; i < 3; ++i) first.step();
    first.save_checkpoint(dir / "ckpt.pt");
  }
  // Resume with another layout: the state is kept by parameter name.
  auto resumed_cfg = c;
  resumed_cfg.pipeline = 1;
  resumed_cfg.load = dir / "ckpt.pt";
  local_trainer resumed(resumed_cfg);
  EXPECT_EQ(resumed.next_step(), 3);
  // Same layout resume must be bit-identical.
  auto same_cfg = c;
  same_cfg.load = dir / "ckpt.pt";
  local_trainer same(same_cfg);
  for (int i = 0; i < 3; ++i) same.step();
  EXPECT_EQ(test::max_abs_diff(same.state(), straight), 0.0);
  for (int i = 0; i < 3; ++i) resumed.step();
  EXPECT_LE(test::max_abs_diff(resumed.state(), straight), 1e-5);
}

TEST(Equivalence, CheckpointOfAnotherModelIsRefused) {
  test::temp_dir dir;
  save_state_dict(dir / "mlp.pt", initial_state(model_spec::fmnist_mlp(), 1));
  auto c = test::gpt_config(5);
  c.init = dir / "mlp.pt";
  EXPECT_THROW(local_trainer t(c), model_error);
}

// Against PyTorch itself: tests/support/python/gpt_reference.py trains gpt-tiny for 5 steps in
// Python (Debian's python3-torch, same library as libtorch-dev) from its own initial
// weights; the C++ trainer started from that file must give the same losses and parameters.
namespace {
// Trains the gpt workload in plain PyTorch (tests/support/python/gpt_reference.py, with `shape` as
// its extra options: config keys,
// given as flags) and here with the same initial weights, pipelined p ways; the losses
// and the final parameters must agree within 1e-5.
void expect_same_as_pytorch(const std::vector<std::pair<std::string, std::string>>& shape,
                            std::initializer_list<int> pipelines) {
  test::temp_dir dir;
  constexpr int steps = 5;
  std::string cmd = std::string("/usr/bin/python3 ") + TROUPE_SOURCE_DIR + "/tests/support/python/gpt_reference.py " +
                    dir.path.string() + " " + std::to_string(steps) + " 200";
  for (auto [key, value] : shape) {
    std::replace(key.begin(), key.end(), '_', '-');  // the key's flag
    cmd += " --" + key + " " + value;
  }
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::vector<double> expected;
  std::ifstream in(dir / "losses.txt");
  for (double x; in >> x;) expected.push_back(x);
  ASSERT_EQ(expected.size(), std::size_t(steps));

  for (int p : pipelines) {
    auto c = test::gpt_config(200);
    for (const auto& [key, value] : shape) c.set(key, value, "test");
    c.validate();
    c.init = dir / "init.pt";
    c.pipeline = p;
    std::vector<double> losses;
    const auto got = train(c, steps, &losses);
    for (int i = 0; i < steps; ++i) EXPECT_NEAR(losses[i], expected[i], 1e-5) << "p=" << p << " step " << i;
    EXPECT_LE(test::max_abs_diff(got, load_state_dict(dir / "final.pt")), 1e-5) << "p=" << p;
  }
}
}  // namespace

TEST(PytorchReference, SameLossesAndParametersAsPlainPytorch) { expect_same_as_pytorch({}, {1, 2}); }

// The [model] keys: another depth, width, head count, MLP width and sequence length.
TEST(PytorchReference, AnotherShapeGivesTheSameLossesAndParametersAsPlainPytorch) {
  expect_same_as_pytorch({{"layers", "3"}, {"heads", "3"}, {"d_model", "48"}, {"d_ff", "100"}, {"seq_len", "40"}},
                         {1, 3});
}

// llama-tiny (WORKLOADS.md section 3) against tests/support/python/llama_tiny.py, whole
// and in two stages; then another shape, with three query heads per key/value head.
TEST(PytorchReference, LlamaTinyGivesTheSameLossesAndParametersAsPlainPytorch) {
  expect_same_as_pytorch({{"workload", "llama-tiny"}}, {1, 2});
}

TEST(PytorchReference, AnotherLlamaShapeGivesTheSameLossesAndParametersAsPlainPytorch) {
  expect_same_as_pytorch({{"workload", "llama-tiny"}, {"layers", "3"}, {"heads", "6"}, {"kv_heads", "2"},
                          {"d_model", "48"}, {"d_ff", "100"}, {"seq_len", "40"}},
                         {1, 3});
}

// moe-tiny (WORKLOADS.md section 4: Mixtral's top-2 experts, the per-sequence
// load-balancing loss in the backward) against tests/support/python/llama_tiny.py, whole
// and in two stages; then 3 experts, top-1, every block but one dense (moe_every 2).
TEST(PytorchReference, MoeTinyGivesTheSameLossesAndParametersAsPlainPytorch) {
  expect_same_as_pytorch({{"workload", "moe-tiny"}}, {1, 2});
}

TEST(PytorchReference, AnotherMoeShapeGivesTheSameLossesAndParametersAsPlainPytorch) {
  expect_same_as_pytorch({{"workload", "moe-tiny"}, {"layers", "3"}, {"heads", "6"}, {"kv_heads", "2"},
                          {"d_model", "48"}, {"experts", "3"}, {"moe_top_k", "1"}, {"moe_d_ff", "40"},
                          {"moe_every", "2"}, {"seq_len", "40"}},
                         {1, 3});
}

// The capacity factor: each expert computes at most ceil(0.5 x 40 x 2 / 3) = 14 of a
// sequence's 80 (token, choice) pairs, those the router gives the most probability, in the
// plain-PyTorch reference's own per-sequence loop too.
TEST(PytorchReference, MoeWithACapacityFactorGivesTheSameLossesAndParametersAsPlainPytorch) {
  expect_same_as_pytorch({{"workload", "moe-tiny"}, {"layers", "3"}, {"heads", "6"}, {"kv_heads", "2"},
                          {"d_model", "48"}, {"experts", "3"}, {"moe_d_ff", "40"}, {"seq_len", "40"},
                          {"moe_capacity_factor", "0.5"}},
                         {1, 3});
}

TEST(FmnistMlp, OneEpochReachesEightyThreePercent) {
  auto c = job_config::defaults_for("fmnist-mlp");
  local_trainer t(c);
  const double before = t.evaluate().accuracy;
  while (t.next_step() < c.steps) t.step();
  const double acc = t.evaluate().accuracy;
  EXPECT_GE(acc, 0.83) << "test accuracy after one epoch";
  EXPECT_LT(before, 0.3);
}

TEST(FmnistMlp, TwoStagesTwoReplicasEqualOneProcess) {
  auto c = job_config::defaults_for("fmnist-mlp");
  c.steps = 20;
  const auto one = train(c, 20);
  c.pipeline = 2;
  c.data_parallel = 2;
  c.microbatches = 2;
  EXPECT_LE(test::max_abs_diff(train(c, 20), one), 1e-5);
}

}  // namespace troupe

namespace troupe {

// Evaluation takes long validation windows a few at a time (eval_tokens_per_forward): the
// loss is that of all of them in one forward up to float rounding, and the memory the
// evaluation takes at its peak is a fraction (here 32 windows of 1024 tokens, as
// gpt-small's: their attention scores alone were 268 MB per block at once).
TEST(Evaluation, LongWindowsGoThroughTheModelAFewAtATime) {
  const int threads = torch::get_num_threads();  // given back: later tests of this process compare at theirs
  torch::set_num_threads(1);
  struct restore_threads {
    int n;
    ~restore_threads() { torch::set_num_threads(n); }
  } restore{threads};
  model_spec spec;
  spec.decoder = {2, 2, 32, 64, 1024, 256};  // gpt-small's window length on a small model
  local_pipeline model(spec, initial_state(spec, 3), 1);
  std::vector<std::uint8_t> text(text_corpus::min_bytes(1024) + 5000);
  for (std::size_t i = 0; i < text.size(); ++i) text[i] = std::uint8_t(" etaoinshrdlu\n"[(i * 7919 + i / 13) % 14]);
  const auto set = text_corpus(text).validation_batch(1024);
  ASSERT_EQ(set.input.size(0), 32);
  // Peak of malloc's bytes in use above the start while evaluate_model runs (sampled).
  auto evaluate = [&](std::int64_t tokens_per_forward, std::int64_t& peak) {
    const auto before = test::malloc_bytes_in_use();
    std::atomic<bool> done{false};
    std::atomic<std::int64_t> high{0};
    std::thread sampler([&] {
      while (!done) {
        high = std::max<std::int64_t>(high, test::malloc_bytes_in_use() - before);
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    });
    const double loss = evaluate_model(model, set, true, 0, tokens_per_forward).loss;
    done = true;
    sampler.join();
    peak = high;
    return loss;
  };
  std::int64_t whole_peak = 0, default_peak = 0, one_peak = 0;
  const double whole = evaluate(32 * 1024, whole_peak);
  const double by_eight = evaluate(eval_tokens_per_forward, default_peak);  // 8 windows a forward
  const double by_one = evaluate(1, one_peak);                              // 1 window a forward
  std::printf("evaluation peaks: 32 windows a forward %.1f MB, 8: %.1f MB, 1: %.1f MB; losses %.9f %.9f %.9f\n",
              whole_peak / 1e6, default_peak / 1e6, one_peak / 1e6, whole, by_eight, by_one);
  EXPECT_NEAR(by_eight, whole, 1e-6 * whole);
  EXPECT_NEAR(by_one, whole, 1e-6 * whole);
  EXPECT_LT(default_peak, whole_peak / 2) << "peaks: " << default_peak << " (8 windows) vs " << whole_peak << " (32)";
  EXPECT_LT(one_peak, default_peak) << "peaks: " << one_peak << " (1 window) vs " << default_peak << " (8)";
  // gpt-tiny's validation windows stay one forward, as before.
  EXPECT_GE(eval_tokens_per_forward / model_spec::gpt_tiny().decoder.seq_len, 32);
}

}  // namespace troupe
