// Tensor parallelism in the actor runtime: T stage actors per stage and replica, meeting in
// their group's collectives. Against the local loop of the same layout (which
// tensor_parallel_test.cpp checks against the unsplit run) and the unsplit run itself;
// the trace's collectives against Megatron's count; checkpoint files and folders across
// widths; a rank that fails mid-step retried in place; and the layouts the runtime refuses.
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "actors/runtime.hpp"
#include "compute/checkpoint/checkpoint.hpp"
#include "compute/checkpoint/checkpoint_dir.hpp"
#include "compute/parallel/tensor_parallel.hpp"
#include "compute/models/tensor_parallel_layout.hpp"
#include "compute/trainer/local_trainer.hpp"
#include "actors/tp_groups.hpp"
#include "test_util.hpp"
#include "tp_test_util.hpp"

namespace troupe {

namespace {

using namespace tp_test;

/// tp_test's small job with 4 micro-batches of 4: 5 steps take about a second in either
/// runtime.
job_config tp_job(const std::string& workload = "gpt-tiny") {
  auto c = small_job(workload);
  c.steps = 5;
  c.threads = 1;
  c.global_batch = 16;
  c.microbatches = 4;
  return c;
}

struct run {
  state_dict state;
  std::vector<double> losses;
  double eval_loss = 0;
};

run local_run(job_config c) {
  c.runtime = "local";
  local_trainer t(c, std::nullopt, in_process_groups);
  run out;
  for (int i = 0; i < c.steps; ++i) out.losses.push_back(t.step().loss);
  out.state = t.state();
  out.eval_loss = t.evaluate().loss;
  return out;
}

actor_run_result actors_run(job_config c) {
  c.runtime = "actors";
  actor_run_options opts;
  opts.quiet = true;
  return run_actor_training(c, opts);
}

job_config job_of(const tp_layout& l) {
  auto c = with_layout(tp_job(l.workload), l);
  c.eval_interval = c.steps;  // one evaluation through the stage actors, at the end
  return c;
}

class TensorParallelActors : public ::testing::TestWithParam<tp_layout> {};

}  // namespace

TEST_P(TensorParallelActors, FollowTheLocalLoopAndTheUnsplitRun) {
  const auto l = GetParam();
  const auto c = job_of(l);
  const auto got = actors_run(c);
  ASSERT_EQ(got.exit_code, 0) << got.error;
  // The local loop of the same layout: the same computation, only the order of some
  // sums differs (the data-parallel reduce-scatter, the gradient norm's partials).
  const auto same = local_run(c);
  EXPECT_LE(test::max_abs_diff(got.final_state, same.state), 1e-6) << name_of(l);
  ASSERT_EQ(got.losses.size(), same.losses.size());
  for (std::size_t i = 0; i < same.losses.size(); ++i) EXPECT_NEAR(got.losses[i], same.losses[i], 1e-6) << i;
  // The unsplit run (T = P = D = 1): WORKLOADS.md's 1e-5.
  auto whole = c;
  whole.tensor_parallel = whole.pipeline = whole.data_parallel = whole.chunks = 1;
  whole.sequence_parallel = false;
  whole.schedule = "1f1b";
  const auto ref = local_run(whole);
  EXPECT_LE(test::max_abs_diff(got.final_state, ref.state), 1e-5) << name_of(l);
  for (std::size_t i = 0; i < ref.losses.size(); ++i) EXPECT_NEAR(got.losses[i], ref.losses[i], 1e-5) << i;
  // The evaluation through the tensor-parallel stage actors (vocab-parallel logits).
  ASSERT_EQ(got.evaluations.size(), 1u);
  EXPECT_NEAR(got.evaluations[0].loss, ref.eval_loss, 1e-5);
  // Every stage actor of every rank ran: T pipelines per replica on the trace.
  std::set<int> pipelines;
  for (const auto& e : got.events)
    if (e.name == "F") pipelines.insert(e.replica);
  EXPECT_EQ(int(pipelines.size()), l.t * l.d);
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, TensorParallelActors,
    // One layout per combination of dimensions (the local loop's sweep covers the rest),
    // every fixed schedule kind, recompute, llama's grouped-query attention.
    ::testing::Values(tp_layout{2, 1, 1, false, "gpt-tiny", "1f1b", "none"},
                      tp_layout{4, 1, 1, true, "gpt-tiny", "1f1b", "none"},
                      tp_layout{2, 2, 1, false, "gpt-tiny", "gpipe", "none"},
                      tp_layout{2, 1, 2, true, "gpt-tiny", "1f1b", "none"},
                      tp_layout{2, 2, 2, true, "gpt-tiny", "1f1b", "none"},
                      tp_layout{4, 2, 1, true, "gpt-tiny", "interleaved-1f1b", "none"},
                      tp_layout{2, 2, 1, true, "gpt-tiny", "zero-bubble", "selective"},
                      tp_layout{2, 2, 2, true, "llama-tiny", "1f1b", "full"},
                      tp_layout{2, 2, 1, false, "llama-tiny", "zero-bubble", "none"}),
    [](const ::testing::TestParamInfo<tp_layout>& info) { return name_of(info.param); });

TEST(TensorParallelActors, TheTraceShowsMegatronsCollectivesPerLayerAndMicroBatch) {
  // Without sequence parallelism: per block and micro-batch, f's all-reduce backward and
  // g's forward, for attention and for the MLP (4 of b s h elements); beside them the
  // embedding's g (forward) and the tied output layer's f (backward). With it, the same
  // bytes as an all-gather entering each column-parallel layer and a reduce-scatter
  // leaving each row-parallel one (forward, and the other one backward).
  for (const bool sp : {false, true}) {
    auto c = tp_job();
    c.tensor_parallel = 2;
    c.sequence_parallel = sp;
    c.steps = 1;
    const auto got = actors_run(c);
    ASSERT_EQ(got.exit_code, 0) << got.error;
    const std::int64_t bsh = std::int64_t(c.microbatch_size()) * c.seq_len * c.d_model * 4;  // fp32 bytes
    // Per rank, by name: the group's collectives of b s h elements (a reduce-scatter's
    // event gives the piece this rank gets: 1/T of them).
    std::map<std::string, int> whole;
    for (const auto& e : got.events)
      if (e.replica == 0 && e.stage == 0 &&
          ((e.bytes == bsh && (e.name == "tp all-reduce" || e.name == "tp all-gather")) ||
           (e.bytes == bsh / 2 && e.name == "tp reduce-scatter")))
        ++whole[e.name];
    const int m = c.microbatches, blocks = c.layers;
    if (!sp) {
      EXPECT_EQ(whole["tp all-reduce"], m * (4 * blocks + 2));
      EXPECT_EQ(whole["tp all-gather"] + whole["tp reduce-scatter"], 0);
    } else {
      // Each block: 2 all-gathers and 2 reduce-scatters forward, and as many backward;
      // the embedding's reduce-scatter (its backward: an all-gather), the output layer's
      // all-gather (its backward: a reduce-scatter).
      EXPECT_EQ(whole["tp all-gather"], m * (4 * blocks + 2)) << "all-gathers";
      EXPECT_EQ(whole["tp reduce-scatter"], m * (4 * blocks + 2)) << "reduce-scatters";
    }
    // Each of them inside the op it served: a forward's or a backward's micro-batch.
    for (const auto& e : got.events)
      if (e.name.rfind("tp ", 0) == 0) EXPECT_GE(e.mb, 0) << e.name;
  }
}

TEST(TensorParallelActors, CheckpointFilesAreWholeAndResumeWithOtherWidths) {
  test::temp_dir dir;
  const auto path = dir / "tp2.pt";
  auto two = tp_job();
  two.tensor_parallel = 2;
  two.sequence_parallel = true;
  two.pipeline = 2;
  two.steps = 3;
  two.save = path;
  const auto first = actors_run(two);
  ASSERT_EQ(first.exit_code, 0) << first.error;
  // The files: the whole model, as torch.save(model.state_dict()) and the unsplit loop
  // write it, equal to the run's own gathered state and to the local loop's file.
  const auto saved = load_state_dict(path);
  check_state(two.model(), saved);
  EXPECT_EQ(test::max_abs_diff(saved, first.final_state), 0.0);
  auto local = two;
  local.runtime = "local";
  local.save.clear();
  local_trainer loop(local, std::nullopt, in_process_groups);
  for (int i = 0; i < 3; ++i) loop.step();
  const auto local_path = dir / "local.pt";
  loop.save_checkpoint(local_path);
  EXPECT_LE(test::max_abs_diff(saved, load_state_dict(local_path)), 1e-6);
  EXPECT_LE(test::max_abs_diff(load_state_dict(path + ".optim"), load_state_dict(local_path + ".optim")), 1e-6);
  // Resumed with T = 1 and T = 4 for two more steps: the same as the local loop resumed
  // from the same file (itself checked across widths in tensor_parallel_checkpoint_test.cpp).
  for (int width : {1, 4}) {
    auto c = two;
    c.tensor_parallel = width;
    c.save.clear();
    c.load = path;
    c.steps = 5;
    const auto resumed = actors_run(c);
    ASSERT_EQ(resumed.exit_code, 0) << resumed.error;
    ASSERT_EQ(resumed.losses.size(), 2u) << width;
    auto l = c;
    l.runtime = "local";
    local_trainer reference(l, std::nullopt, in_process_groups);
    ASSERT_EQ(reference.next_step(), 3);
    for (int i = 3; i < 5; ++i) EXPECT_NEAR(resumed.losses[std::size_t(i - 3)], reference.step().loss, 1e-6) << width;
    EXPECT_LE(test::max_abs_diff(resumed.final_state, reference.state()), 1e-6) << width;
  }
}

TEST(TensorParallelActors, CheckpointFoldersHoldTheWholeModelAndResumeWithOtherWidths) {
  // Replica 0's rank-0 stage actors write each stage's files with their peers' parts put
  // together: the folder holds what the run's --save file holds (the whole parameters and
  // AdamW moments), and resumes with T = 1 and 4.
  test::temp_dir dir;
  auto two = tp_job();
  two.tensor_parallel = 2;
  two.sequence_parallel = true;
  two.pipeline = 2;
  two.data_parallel = 2;
  two.steps = 4;
  two.checkpoint_dir = dir / "ckpt";
  two.checkpoint_interval = 2;
  two.save = dir / "run.pt";
  const auto run = actors_run(two);
  ASSERT_EQ(run.exit_code, 0) << run.error;
  const auto folder = dir / "ckpt/step-00000004";
  const auto ckpt = read_checkpoint_dir(folder, two);
  EXPECT_EQ(ckpt.step, 4);
  EXPECT_EQ(test::max_abs_diff(ckpt.model, load_state_dict(two.save)), 0.0);
  state_dict optim(ckpt.optim.begin(), ckpt.optim.end());
  EXPECT_EQ(test::max_abs_diff(optim, load_state_dict(two.save + ".optim")), 0.0);
  for (int width : {1, 4}) {
    auto c = two;
    c.tensor_parallel = width;
    c.save.clear();
    c.checkpoint_dir.clear();
    c.resume = dir / "ckpt/step-00000002";
    const auto resumed = actors_run(c);
    ASSERT_EQ(resumed.exit_code, 0) << resumed.error;
    ASSERT_EQ(resumed.losses.size(), 2u) << width;
    EXPECT_NEAR(resumed.losses[1], run.losses[3], 1e-6) << width;
    EXPECT_LE(test::max_abs_diff(resumed.final_state, run.final_state), 1e-6) << width;
  }
}

TEST(TensorParallelActors, ARankThatFailsMidStepIsRetriedInPlaceBitIdentically) {
  auto c = tp_job();
  c.tensor_parallel = 2;
  c.sequence_parallel = true;
  c.pipeline = 2;
  c.steps = 3;
  const auto clean = actors_run(c);
  ASSERT_EQ(clean.exit_code, 0) << clean.error;
  // Pipeline 1 (replica 0's tensor-parallel rank 1) at stage 1 throws in step 2, while its
  // peer waits in their group's collective: the group is failed, every actor rebuilt
  // from the snapshots, the step run again.
  c.throw_at = "1:1:1";
  const auto retried = actors_run(c);
  ASSERT_EQ(retried.exit_code, 0) << retried.error;
  EXPECT_EQ(test::max_abs_diff(retried.final_state, clean.final_state), 0.0);
  EXPECT_EQ(retried.losses, clean.losses);
}

TEST(TensorParallelActors, DataflowIsRefusedWithTheReason) {
  const auto error_of = test::config_error_of;
  auto c = tp_job();
  c.runtime = "actors";
  c.tensor_parallel = 2;
  EXPECT_EQ(error_of(c), "");
  c.schedule = "dataflow";
  EXPECT_NE(error_of(c).find("tensor_parallel 2 with schedule dataflow"), std::string::npos) << error_of(c);
}

}  // namespace troupe
