// Evaluation in the pipeline (eval_mode pipeline, Megatron's forward-only schedule)
// against the gathered model's, and its failures.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <thread>

#include <nlohmann/json.hpp>

#include "actor_test_util.hpp"
#include "actors/runtime.hpp"
#include "actors/supervisor_actor.hpp"
#include "actors/trace.hpp"
#include "compute/checkpoint/checkpoint.hpp"
#include "compute/optim/grad_buffer.hpp"
#include "compute/models/partition.hpp"
#include "compute/trainer/local_trainer.hpp"
#include "test_util.hpp"

namespace troupe {

using namespace actor_test;

// eval_mode pipeline (Megatron's forward-only schedule): the validation windows go
// forward only through the stage actors, forward f through replica f mod d, and give the
// numbers of the whole model gathered on node 0 and evaluated there (eval_mode gather;
// fp32: the same forwards, to float rounding). Every stage ran its replica's forwards
// through each of its chunks, each evaluation; gather runs none there.
namespace {

/// The same job evaluating its gathered model (eval_mode gather), then in the pipeline.
std::pair<actor_run_result, actor_run_result> gathered_and_piped(job_config c) {
  c.eval_mode = "gather";
  auto gathered = run_actors(c);
  c.eval_mode = "pipeline";
  return {std::move(gathered), run_actors(c)};
}

}  // namespace

TEST(ActorEvaluation, ThePipelineGivesTheGatheredModelsNumbers) {
  for (const auto& l : {layout{2, 1, 1, "1f1b"}, layout{2, 2, 2, "interleaved-1f1b"}, layout{4, 1, 1, "dataflow"}}) {
    auto c = gpt_layout(l);
    c.steps = 4;
    c.eval_interval = 2;
    c.eval_tokens = 512;  // 8 of the 32 windows of 64 tokens a forward: 4 forwards
    const auto [gathered, piped] = gathered_and_piped(c);
    ASSERT_EQ(gathered.exit_code, 0) << gathered.error;
    ASSERT_EQ(piped.exit_code, 0) << piped.error;
    ASSERT_EQ(piped.evaluations.size(), 2u) << name_of(l);
    ASSERT_EQ(gathered.evaluations.size(), 2u) << name_of(l);
    for (std::size_t i = 0; i < 2; ++i) {
      EXPECT_EQ(piped.evaluations[i].step, 2 * int(i + 1));
      EXPECT_EQ(gathered.evaluations[i].step, piped.evaluations[i].step);
      EXPECT_NEAR(piped.evaluations[i].loss, gathered.evaluations[i].loss, 1e-6) << name_of(l) << " evaluation " << i;
    }
    EXPECT_NE(piped.evaluations[0].loss, piped.evaluations[1].loss);  // trained between them
    std::map<std::pair<int, int>, int> forwards;  // (replica, stage): eval ops
    for (const auto& e : piped.events)
      if (e.name == "eval F") ++forwards[{e.replica, e.stage}];
    for (const auto& e : gathered.events) EXPECT_NE(e.name, "eval F");
    ASSERT_EQ(forwards.size(), std::size_t(l.p * l.d)) << name_of(l);
    for (const auto& [track, n] : forwards) EXPECT_EQ(n, 2 * (4 / l.d) * l.v) << name_of(l);
  }
}

// The classifier's test loss and accuracy too; a bf16 job evaluates in the pipeline as it
// trains (bf16 compute), within 2 % of its model evaluated in fp32.
TEST(ActorEvaluation, FmnistAndBf16InThePipeline) {
  auto m = job_config::defaults_for("fmnist-mlp");
  m.steps = 2;
  m.pipeline = m.data_parallel = m.microbatches = 2;
  const auto [gathered, piped] = gathered_and_piped(m);
  ASSERT_EQ(piped.exit_code, 0) << piped.error;
  ASSERT_EQ(piped.evaluations.size(), 1u);
  ASSERT_EQ(gathered.evaluations.size(), 1u);
  EXPECT_NEAR(piped.evaluations[0].loss, gathered.evaluations[0].loss, 1e-6);
  EXPECT_EQ(piped.evaluations[0].accuracy, gathered.evaluations[0].accuracy);
  EXPECT_GT(piped.evaluations[0].accuracy, 0.3);  // 10 classes: trained, not chance

  auto c = gpt_layout({2, 1, 1, "1f1b"});
  c.steps = 2;
  c.precision = "bf16";
  c.device = "cpu";
  const auto [fp32_compute, bf16_compute] = gathered_and_piped(c);
  ASSERT_EQ(bf16_compute.exit_code, 0) << bf16_compute.error;
  ASSERT_EQ(bf16_compute.evaluations.size(), 1u);
  const double a = bf16_compute.evaluations[0].loss, b = fp32_compute.evaluations.at(0).loss;
  EXPECT_NEAR(a / b, 1.0, 0.02);
  EXPECT_NE(a, b) << "the pipeline's evaluation computes in bf16";
}

// A stage that fails during the evaluation ends the run as a failure after a committed
// step does: exit 75 (the launcher restarts from the newest checkpoint), the step's
// losses kept, no evaluation recorded.
TEST(ActorEvaluation, AStageThatFailsInTheEvaluationEndsTheRunForARestart) {
  auto c = gpt_layout({2, 1, 1, "1f1b"});
  c.steps = 4;
  c.eval_interval = 2;
  c.throw_at = "0:1:1:eval";
  c.step_timeout = 30;
  const auto got = run_actors(c);
  EXPECT_EQ(got.exit_code, exit_recoverable);
  EXPECT_NE(got.error.find("stage[replica 0, stage 1]"), std::string::npos) << got.error;
  EXPECT_NE(got.error.find("the evaluation after step 2/4 failed: "), std::string::npos) << got.error;
  EXPECT_NE(got.error.find("throws in the evaluation after step 2"), std::string::npos) << got.error;
  EXPECT_EQ(got.losses.size(), 2u);
  EXPECT_TRUE(got.evaluations.empty());
}

// `troupe train` and node processes ask for no final state: without --save or a
// checkpoint_dir nothing gathers the whole model (the evaluations ran in the pipeline);
// with --save the file holds the model the run with the final state reports.
TEST(ActorEvaluation, NoFinalStateGathersNothingAtTheEnd) {
  test::temp_dir dir;
  auto c = gpt_layout({2, 1, 1, "1f1b"});
  c.steps = 2;
  const auto with = run_actors(c);
  ASSERT_EQ(with.exit_code, 0) << with.error;
  ASSERT_FALSE(with.final_state.empty());
  actor_run_options opts;
  opts.final_state = false;
  const auto without = run_actors(c, opts);
  ASSERT_EQ(without.exit_code, 0) << without.error;
  EXPECT_TRUE(without.final_state.empty());
  ASSERT_EQ(without.evaluations.size(), 1u);
  EXPECT_EQ(without.evaluations[0].loss, with.evaluations.at(0).loss);
  c.save = dir / "model.pt";
  const auto saved = run_actors(c, opts);
  ASSERT_EQ(saved.exit_code, 0) << saved.error;
  EXPECT_EQ(test::max_abs_diff(load_state_dict(c.save), with.final_state), 0.0);
}

// A lost evaluation result: the evaluation times out (step_timeout) and the run exits for a
// restart; a duplicated one is dropped and counted once.
TEST(ActorEvaluation, ALostResultTimesOutADuplicateCountsOnce) {
  auto c = gpt_layout({2, 1, 1, "1f1b"});
  c.steps = 2;
  c.eval_interval = 0;
  c.eval_tokens = 512;  // 4 forwards of 8 windows of 64 tokens
  const auto clean = run_actors(c);
  ASSERT_EQ(clean.exit_code, 0) << clean.error;
  c.message = "duplicate@0:1:1:eval";
  const auto duplicated = run_actors(c);
  ASSERT_EQ(duplicated.exit_code, 0) << duplicated.error;
  ASSERT_EQ(duplicated.evaluations.size(), 1u);
  EXPECT_EQ(duplicated.evaluations[0].loss, clean.evaluations.at(0).loss);
  c.message = "drop@0:1:1:eval";
  c.step_timeout = 8;  // (the steps too must finish within it: a slow day's steps take seconds)
  const auto t0 = std::chrono::steady_clock::now();
  const auto dropped = run_actors(c);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(dropped.exit_code, exit_recoverable);
  EXPECT_NE(dropped.error.find("the evaluation after step 2/2 failed: not finished within 8 s (3 of 4 forwards scored)"),
            std::string::npos)
      << dropped.error;
  EXPECT_LT(seconds, 40.0);  // the timeout, not a hang
}

// A micro-batch is in flight from its F until its B, or with a split backward until its
// W (its W still needs the activations); a W runs only when it is due.

}  // namespace troupe
