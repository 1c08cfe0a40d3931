// Context parallelism in the actor runtime: C stage actors per stage and replica, each with
// 1/C of every sequence's tokens, meeting in their group's attention. Against the unsplit
// run of the same layout (the same job without context parallelism): the parameters after
// 3 steps, every step's loss and the evaluation's, for each comm, C = 2 and 4, alone and
// with tensor (and sequence), pipeline and data parallelism; and the layouts refused.
#include <gtest/gtest.h>

#include <algorithm>

#include <fstream>
#include <map>
#include <string>

#include <nlohmann/json.hpp>

#include "actors/runtime.hpp"
#include "compute/checkpoint/checkpoint.hpp"
#include "compute/checkpoint/checkpoint_dir.hpp"
#include "compute/config/config_error.hpp"
#include "temp_dir.hpp"
#include "test_util.hpp"
#include "tp_test_util.hpp"

namespace troupe {

namespace {

struct cp_layout {
  int c;
  const char* comm;
  int t, p, d;
  const char* schedule;
  const char* recompute;
  const char* workload = "llama-tiny";
  int experts = 0, ep = 1;  // a mixture of experts (top 2) over `ep` expert-parallel ranks
  double capacity = 0;      // their capacity factor (0: none)
};

std::string name_of(const cp_layout& l) {
  std::string s = std::string(l.comm) + "_c" + std::to_string(l.c) + "_t" + std::to_string(l.t) + "_p" +
                  std::to_string(l.p) + "_d" + std::to_string(l.d);
  if (std::string(l.schedule) != "1f1b") s += l.schedule[0] == 'z' ? "_zero_bubble" : "_interleaved";
  if (std::string(l.recompute) != "none") s += std::string("_recompute_") + l.recompute;
  if (l.experts) s += "_e" + std::to_string(l.experts) + "_ep" + std::to_string(l.ep);
  if (l.capacity > 0) s += "_capacity";
  return std::string(l.workload) + "_" + s;
}

/// llama-tiny's shape (or gpt-tiny's: learned positions) at 2 layers per stage of width
/// 64, 8 query and 4 key/value heads, sequences of 256 (C = 4: 8 chunks of 32 tokens), 2
/// micro-batches of 4 per replica, 3 steps and the evaluation at the end (through the stage
/// actors).
job_config cp_job(const cp_layout& l) {
  auto c = tp_test::small_job(l.workload);
  c.runtime = "actors";
  c.steps = 3;
  c.layers = 2 * l.p;
  c.threads = 1;
  c.heads = 8;
  if (std::string(l.workload) != "gpt-tiny") c.kv_heads = 4;  // (gpt2: every head its own keys)
  c.seq_len = 256;
  c.global_batch = 8 * l.d;
  c.microbatches = 2;
  c.eval_interval = 0;  // (the run's end evaluates)
  c.tensor_parallel = l.t;
  c.sequence_parallel = l.t > 1;
  c.pipeline = l.p;
  c.data_parallel = l.d;
  c.schedule = l.schedule;
  if (c.schedule == "interleaved-1f1b") c.chunks = 2;
  c.recompute = l.recompute;
  c.context_parallel = l.c;
  c.context_parallel_comm = l.comm;
  if (l.experts) {
    c.experts = l.experts;
    c.moe_top_k = 2;
    c.expert_parallel = l.ep;
    c.moe_capacity_factor = l.capacity;
  }
  return c;
}

actor_run_result actors_run(const job_config& c) {
  actor_run_options opts;
  opts.quiet = true;
  return run_actor_training(c, opts);
}

/// The unsplit run of `c`'s layout (context_parallel 1), once per layout.
const actor_run_result& unsplit_run(job_config c) {
  static std::map<std::string, actor_run_result> runs;
  c.context_parallel = 1;
  c.context_parallel_comm = "p2p";
  const auto key = c.to_toml();
  auto it = runs.find(key);
  if (it == runs.end()) it = runs.emplace(key, actors_run(c)).first;
  return it->second;
}


}  // namespace

// (One test, so that the layouts sharing an unsplit run compute it once: its attention
// over whole sequences is most of the time.)
TEST(ContextParallelActors, FollowTheUnsplitRunInEveryLayout) {
  const cp_layout layouts[] = {
      {2, "p2p", 1, 1, 1, "1f1b", "none"},       {4, "p2p", 1, 1, 1, "1f1b", "none"},
      {2, "a2a", 1, 1, 1, "1f1b", "none"},       {4, "a2a", 1, 1, 1, "1f1b", "none"},
      {2, "allgather", 1, 1, 1, "1f1b", "none"}, {4, "allgather", 1, 1, 1, "1f1b", "none"},
      {2, "p2p", 2, 1, 1, "1f1b", "none"},       {2, "a2a", 2, 1, 1, "1f1b", "none"},
      {2, "p2p", 1, 2, 1, "interleaved-1f1b", "full"}, {2, "allgather", 1, 2, 1, "interleaved-1f1b", "full"},
      {2, "p2p", 1, 2, 1, "zero-bubble", "none"},
      {2, "a2a", 1, 1, 2, "1f1b", "none"},       {2, "p2p", 1, 1, 1, "1f1b", "none", "gpt-tiny"},
      // Experts: the load-balancing loss over whole sequences (its sums over the group).
      {2, "p2p", 1, 1, 1, "1f1b", "none", "llama-tiny", 4, 1},
      {2, "p2p", 2, 1, 1, "1f1b", "none", "llama-tiny", 4, 1},  // (and over the sequence-parallel ranks)
      {2, "a2a", 1, 1, 2, "1f1b", "none", "llama-tiny", 4, 2},
      // An expert capacity: the whole sequences' most probable pairs stay (each rank
      // decides on every rank's router probabilities, and keeps its own tokens').
      {2, "p2p", 1, 1, 1, "1f1b", "none", "llama-tiny", 4, 1, 0.5},
      {4, "a2a", 2, 1, 1, "1f1b", "none", "llama-tiny", 4, 1, 0.5}};
  for (const auto& l : layouts) {
    SCOPED_TRACE(name_of(l));
    test::temp_dir dir;  // (experts: both runs' metrics)
    auto c = cp_job(l);
    if (l.experts) c.metrics = dir / "whole.jsonl";
    const auto& want = unsplit_run(c);
    ASSERT_EQ(want.exit_code, 0) << want.error;
    if (l.experts) c.metrics = dir / "split.jsonl";
    const auto got = actors_run(c);
    ASSERT_EQ(got.exit_code, 0) << got.error;
    // The same computation but for the order of sums: the attention's blocks merged by
    // their log-sum-exp, the gradients averaged over data x context ranks.
    EXPECT_LE(test::max_abs_diff(got.final_state, want.final_state), 1e-5);
    if (l.experts) {  // the whole sequences' load-balancing loss, reported once; the same routed tokens
      std::ifstream whole(dir / "whole.jsonl"), split(dir / "split.jsonl");
      int lines = 0;
      for (std::string a, b; std::getline(whole, a) && std::getline(split, b); ++lines) {
        const auto x = nlohmann::json::parse(a), y = nlohmann::json::parse(b);
        EXPECT_GT(x.at("aux_loss").get<double>(), 0.0);
        EXPECT_NEAR(y.at("aux_loss").get<double>(), x.at("aux_loss").get<double>(), 1e-6) << "step " << lines;
        EXPECT_EQ(y.at("expert_tokens_max"), x.at("expert_tokens_max")) << "step " << lines;
        EXPECT_EQ(y.at("expert_tokens_min"), x.at("expert_tokens_min")) << "step " << lines;
        if (l.capacity > 0) {  // the same pairs dropped, and some are
          EXPECT_GT(x.at("expert_dropped").get<std::int64_t>(), 0) << "step " << lines;
          EXPECT_EQ(y.at("expert_dropped"), x.at("expert_dropped")) << "step " << lines;
        }
      }
      EXPECT_EQ(lines, c.steps);
    }
    ASSERT_EQ(got.losses.size(), want.losses.size());
    for (std::size_t i = 0; i < got.losses.size(); ++i) EXPECT_NEAR(got.losses[i], want.losses[i], 1e-5) << "step " << i;
    ASSERT_EQ(got.evaluations.size(), want.evaluations.size());
    for (std::size_t i = 0; i < got.evaluations.size(); ++i)
      EXPECT_NEAR(got.evaluations[i].loss, want.evaluations[i].loss, 1e-5);
  }
}

TEST(ContextParallelActors, CheckpointFoldersResumeWithOtherWidths) {
  // Replica 0's context-parallel rank 0 writes the folder (every rank holds the whole
  // parameters; the moments come from the data x context shards): it holds what the
  // run's --save file holds, and resumes with C = 1 and 4.
  test::temp_dir dir;
  auto two = cp_job({2, "p2p", 1, 2, 1, "1f1b", "none"});
  two.seq_len = 128;
  two.steps = 4;
  two.checkpoint_dir = dir / "ckpt";
  two.checkpoint_interval = 2;
  two.checkpoint_async = false;
  two.save = dir / "run.pt";
  const auto run = actors_run(two);
  ASSERT_EQ(run.exit_code, 0) << run.error;
  const auto ckpt = read_checkpoint_dir(dir / "ckpt/step-00000004", two);
  EXPECT_EQ(ckpt.step, 4);
  EXPECT_EQ(test::max_abs_diff(ckpt.model, load_state_dict(two.save)), 0.0);
  state_dict optim(ckpt.optim.begin(), ckpt.optim.end());
  EXPECT_EQ(test::max_abs_diff(optim, load_state_dict(two.save + ".optim")), 0.0);
  for (int width : {1, 4}) {
    auto c = two;
    c.context_parallel = width;
    c.save.clear();
    c.checkpoint_dir.clear();
    c.resume = dir / "ckpt/step-00000002";
    const auto resumed = actors_run(c);
    ASSERT_EQ(resumed.exit_code, 0) << resumed.error;
    ASSERT_EQ(resumed.losses.size(), 2u) << width;
    EXPECT_NEAR(resumed.losses[1], run.losses[3], 1e-5) << width;
    EXPECT_LE(test::max_abs_diff(resumed.final_state, run.final_state), 1e-5) << width;
  }
}

TEST(ContextParallelActors, ARankThatFailsMidStepIsRetriedInPlaceBitIdentically) {
  auto c = cp_job({2, "p2p", 1, 2, 1, "1f1b", "none"});
  c.seq_len = 128;
  c.steps = 3;
  const auto clean = actors_run(c);
  ASSERT_EQ(clean.exit_code, 0) << clean.error;
  // Pipeline 1 (replica 0's context-parallel rank 1) at stage 0 throws in step 2, while
  // its peer waits in their ring: the group is failed, every actor rebuilt from the
  // snapshots, the step run again.
  c.throw_at = "1:0:1";
  const auto retried = actors_run(c);
  ASSERT_EQ(retried.exit_code, 0) << retried.error;
  EXPECT_EQ(test::max_abs_diff(retried.final_state, clean.final_state), 0.0);
  EXPECT_EQ(retried.losses, clean.losses);
}

TEST(ContextParallelActors, TheGroupsCollectivesAreOnTheTraceInsideTheOpsTheyServe) {
  // p2p at C = 2, two layers per stage, two micro-batches: per layer and micro-batch the
  // forward waits for C - 1 key/value shifts, the backward for C - 1 key/value shifts and
  // C gradient sums; each wait is a "cp ring shift" event inside its F or B op.
  constexpr int C = 2, layers = 2, m = 2;
  auto c = cp_job({C, "p2p", 1, 2, 1, "1f1b", "none"});
  c.seq_len = 128;
  c.steps = 2;
  const auto run = actors_run(c);
  ASSERT_EQ(run.exit_code, 0) << run.error;
  for (int pipe = 0; pipe < C; ++pipe)
    for (int stage = 0; stage < 2; ++stage) {
      SCOPED_TRACE("pipeline " + std::to_string(pipe) + ", stage " + std::to_string(stage));
      int in_forward = 0, in_backward = 0;
      for (const auto& e : run.events) {
        if (e.name != "cp ring shift" || e.replica != pipe || e.stage != stage || e.step != 0) continue;
        const auto op = std::find_if(run.events.begin(), run.events.end(), [&](const trace_event& o) {
          return (o.name == "F" || o.name == "B") && o.replica == pipe && o.stage == stage && o.step == 0 &&
                 o.mb == e.mb && o.start_us <= e.start_us && e.end_us <= o.end_us;
        });
        ASSERT_NE(op, run.events.end()) << "a shift outside its op, mb " << e.mb;
        (op->name == "F" ? in_forward : in_backward) += 1;
      }
      EXPECT_EQ(in_forward, layers * m * (C - 1));
      EXPECT_EQ(in_backward, layers * m * (2 * C - 1));
    }
  // a2a: its all-to-alls on every rank's track.
  c.context_parallel_comm = "a2a";
  c.steps = 1;
  const auto a2a = actors_run(c);
  ASSERT_EQ(a2a.exit_code, 0) << a2a.error;
  for (int pipe = 0; pipe < C; ++pipe)
    EXPECT_GT(std::count_if(a2a.events.begin(), a2a.events.end(),
                            [&](const trace_event& e) { return e.name == "cp all-to-all" && e.replica == pipe; }),
              0);
}

TEST(ContextParallelConfig, RefusesWhatCannotWork) {
  auto base = cp_job({2, "p2p", 1, 1, 1, "1f1b", "none"});
  auto refused = [&](auto edit, const std::string& why) {
    auto c = base;
    edit(c);
    try {
      c.validate();
      ADD_FAILURE() << "accepted: " << why;
    } catch (const config_error& e) {
      EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
    }
  };
  refused([](job_config& c) { c.seq_len = 510; }, "divisible by 2 x 2");
  refused([](job_config& c) { c.context_parallel_comm = "ring"; }, "expected p2p, a2a or allgather");
  refused([](job_config& c) { c.context_parallel = 8; c.context_parallel_comm = "a2a"; c.kv_heads = 4; c.heads = 12; c.d_model = 96; },
          "a2a trades heads for sequence");
  refused([](job_config& c) { c.runtime = "local"; }, "runs in the actor runtime");
  refused([](job_config& c) { c.schedule = "dataflow"; }, "schedule dataflow");
  refused([](job_config& c) { c.device = "cuda"; }, "not yet on GPUs");
  refused([](job_config& c) { c.workload = "fmnist-mlp"; c.heads = 0; c.kv_heads = 0; c.seq_len = 0; c.layers = 0; c.d_model = 0; },
          "no sequences to split");
  base.validate();  // the base itself is fine
}

}  // namespace troupe
