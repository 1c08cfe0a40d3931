// Fully sharded data parallelism in the actor runtime (parallel.shard gradients and
// parameters: ZeRO-2 and ZeRO-3) against the distributed optimizer (ZeRO-1) of the same
// layout: the parameters after 10 steps, every step's loss and the evaluation's; the
// checkpoint folders a sharded run writes, resumed at other widths and levels; an
// in-place retry; hybrid sharding (shard groups smaller than the data-parallel group);
// and the layouts refused.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "actors/runtime.hpp"
#include "compute/checkpoint/checkpoint.hpp"
#include "compute/checkpoint/checkpoint_dir.hpp"
#include "compute/config/config_error.hpp"
#include "compute/models/parameters.hpp"
#include "temp_dir.hpp"
#include "test_util.hpp"
#include "tp_test_util.hpp"

namespace troupe {

namespace {

struct fsdp_layout {
  int p, d, t;
  const char* schedule;
  const char* recompute;
  int microbatches = 2;
  const char* precision = "fp32";
  const char* workload = "llama-tiny";
  int c = 1;
  bool sp = false;  // sequence parallelism (with t > 1)
  int experts = 0, ep = 1;  // a mixture of experts (top 2), over `ep` expert-parallel ranks
};

std::string name_of(const fsdp_layout& l) {
  return std::string(l.workload) + "_p" + std::to_string(l.p) + "_d" + std::to_string(l.d) + "_t" +
         std::to_string(l.t) + (l.c > 1 ? "_c" + std::to_string(l.c) : "") + "_" + l.schedule + "_recompute_" +
         l.recompute + "_m" + std::to_string(l.microbatches) + "_" + l.precision + (l.sp ? "_sp" : "") +
         (l.experts ? "_e" + std::to_string(l.experts) + "_ep" + std::to_string(l.ep) : "");
}

/// llama-tiny's shape at 2 layers per stage of width 64, sequences of 32, micro-batches
/// of 2, 10 steps and the evaluation at the end.
job_config fsdp_job(const fsdp_layout& l, const std::string& shard) {
  auto c = tp_test::small_job(l.workload);
  c.runtime = "actors";
  c.steps = 10;
  const bool two_chunks = std::string(l.schedule) == "interleaved-1f1b" || std::string(l.schedule) == "zbv";
  c.layers = 2 * l.p * (two_chunks ? 2 : 1);
  c.threads = 1;
  c.pipeline = l.p;
  c.data_parallel = l.d;
  c.tensor_parallel = l.t;
  c.sequence_parallel = l.sp;
  c.context_parallel = l.c;
  if (l.experts) {
    c.experts = l.experts;
    c.moe_top_k = 2;
    c.expert_parallel = l.ep;
  }
  c.microbatches = l.microbatches;
  c.global_batch = 2 * l.microbatches * l.d;
  c.schedule = l.schedule;
  if (two_chunks) c.chunks = 2;
  c.recompute = l.recompute;
  c.precision = l.precision;
  c.bucket_size = 2000;  // several buckets per chunk, a boundary inside a parameter
  c.shard = shard;
  c.eval_mode = "gather";  // (what parameters sharded evaluate with: the same path at every level)
  return c;
}

actor_run_result actors_run(const job_config& c) {
  actor_run_options opts;
  opts.quiet = true;
  return run_actor_training(c, opts);
}

void expect_close(const actor_run_result& got, const actor_run_result& want, double tol) {
  EXPECT_LE(test::max_abs_diff(got.final_state, want.final_state), tol);
  ASSERT_EQ(got.losses.size(), want.losses.size());
  for (std::size_t i = 0; i < got.losses.size(); ++i) EXPECT_NEAR(got.losses[i], want.losses[i], tol) << "step " << i;
  ASSERT_EQ(got.evaluations.size(), want.evaluations.size());
  for (std::size_t i = 0; i < got.evaluations.size(); ++i)
    EXPECT_NEAR(got.evaluations[i].loss, want.evaluations[i].loss, tol);
}

/// Parameters sharded: step folder `folder` of run `c` holds a file of each shard of the
/// first shard group (hybrid sharding: the copies in the other groups write none) and no
/// stage file. Each is a torch state_dict of flat pieces "KIND.NAME@OFFSET/NUMEL"; a file
/// holds about 1/(g t) of its stage's main parameters and, without tensor parallelism,
/// the files' together are the model's parameters, each element once.
void expect_written_by_every_shard(const job_config& c, const std::string& folder) {
  namespace fs = std::filesystem;
  const int t = c.tensor_parallel, pipes = c.data_parallel * c.context_parallel * t;
  const int g = c.shard_group > 0 ? c.shard_group : c.data_parallel * c.context_parallel;
  std::int64_t total = 0;
  for (int k = 0; k < c.pipeline; ++k) {
    const auto stage = std::to_string(k);
    EXPECT_FALSE(fs::exists(folder + "/stage-" + stage + ".pt"));
    EXPECT_FALSE(fs::exists(folder + "/optim-stage-" + stage + ".pt"));
    std::vector<std::int64_t> mains;
    for (int q = 0; q < pipes; ++q) {
      const auto file = folder + "/stage-" + stage + "-shard-" + std::to_string(q) + ".pt";
      const bool writes = q / t / g == 0;
      ASSERT_EQ(fs::exists(file), writes) << file;
      if (!writes) continue;
      std::int64_t main = 0, keys = 0;
      for (const auto& [key, tensor] : load_state_dict(file)) {
        if (key.rfind("main.", 0) != 0) continue;
        EXPECT_NE(key.find('@'), std::string::npos) << key;
        EXPECT_EQ(tensor.dim(), 1) << key;
        main += tensor.numel();
        ++keys;
      }
      EXPECT_GT(keys, 0) << file;
      mains.push_back(main);
    }
    std::int64_t of_stage = 0;
    for (auto n : mains) of_stage += n;
    for (auto n : mains) EXPECT_LE(double(n), 1.25 * double(of_stage) / double(mains.size())) << "stage " << k;
    total += of_stage;
  }
  if (t == 1) {
    EXPECT_EQ(total, parameter_count(c.model()));
  }
}

/// `c` run for 4 steps with a checkpoint folder every 2 and --save: the last folder
/// holds what --save wrote and the run's final state (parameters sharded: written by
/// every shard); the folder of step 2 resumed at each (replicas, level) of `others`
/// (shard groups: the whole group) ends where the run ended.
void expect_resumed(job_config c, const std::vector<std::pair<int, const char*>>& others) {
  test::temp_dir dir;
  c.steps = 4;
  c.checkpoint_dir = dir / "ckpt";
  c.checkpoint_interval = 2;
  c.save = dir / "run.pt";
  const auto run = actors_run(c);
  ASSERT_EQ(run.exit_code, 0) << run.error;
  if (c.shard == "parameters") {
    expect_written_by_every_shard(c, dir / "ckpt/step-00000004");
  }
  const auto ckpt = read_checkpoint_dir(dir / "ckpt/step-00000004", c);
  EXPECT_EQ(ckpt.step, 4);
  EXPECT_EQ(test::max_abs_diff(ckpt.model, load_state_dict(c.save)), 0.0);
  EXPECT_EQ(test::max_abs_diff(ckpt.model, run.final_state), 0.0);
  state_dict optim(ckpt.optim.begin(), ckpt.optim.end());
  EXPECT_EQ(test::max_abs_diff(optim, load_state_dict(c.save + ".optim")), 0.0);
  for (const auto& [d, level] : others) {
    auto r = c;
    r.data_parallel = d;
    r.microbatches = c.global_batch / (2 * d);
    r.shard = level;
    r.shard_group = 0;
    r.save.clear();
    r.checkpoint_dir.clear();
    r.resume = dir / "ckpt/step-00000002";
    const auto resumed = actors_run(r);
    ASSERT_EQ(resumed.exit_code, 0) << resumed.error;
    ASSERT_EQ(resumed.losses.size(), 2u) << level;
    EXPECT_NEAR(resumed.losses[1], run.losses[3], 1e-5) << level;
    EXPECT_LE(test::max_abs_diff(resumed.final_state, run.final_state), 1e-5) << level;
  }
}

/// Both runs ended, with the same bits and losses.
void expect_same_bits(const actor_run_result& got, const actor_run_result& want) {
  ASSERT_EQ(want.exit_code, 0) << want.error;
  ASSERT_EQ(got.exit_code, 0) << got.error;
  EXPECT_EQ(test::max_abs_diff(got.final_state, want.final_state), 0.0);
  EXPECT_EQ(got.losses, want.losses);
}

/// `c` for 3 steps, and again with the stage `throw_at` names throwing mid-step: the step
/// retried in place gives the clean run's bits. Neither process kept the initial
/// parameters after its actors took them, so the retry's actors took theirs from the
/// snapshots alone.
void expect_retried_in_place(job_config c, const std::string& throw_at) {
  c.steps = 3;
  const auto clean = actors_run(c);
  c.throw_at = throw_at;
  const auto retried = actors_run(c);
  expect_same_bits(retried, clean);
  EXPECT_EQ(clean.initial_bytes_held, 0);
  EXPECT_EQ(retried.initial_bytes_held, 0);
}

}  // namespace

// (One test: each layout's ZeRO-1 run serves both sharded levels.)
TEST(FsdpActors, GradientsAndParametersShardedFollowZeRO1InEveryLayout) {
  const fsdp_layout layouts[] = {
      {1, 2, 1, "1f1b", "none"},
      {1, 4, 1, "1f1b", "none"},
      {1, 2, 1, "1f1b", "none", 1},  // one micro-batch
      {2, 2, 1, "interleaved-1f1b", "full"},
      {2, 2, 1, "zero-bubble", "none"},
      {2, 2, 1, "gpipe", "selective"},
      {1, 2, 2, "1f1b", "none"},  // tensor parallelism (no sequence parallelism)
      {1, 2, 2, "1f1b", "none", 2, "fp32", "llama-tiny", 1, true},  // and with it
      {2, 2, 2, "interleaved-1f1b", "none", 4, "fp32", "llama-tiny", 1, true},
      {1, 2, 1, "1f1b", "none", 2, "fp32", "llama-tiny", 1, false, 4, 1},  // experts on every rank
      {1, 4, 1, "1f1b", "none", 2, "fp32", "llama-tiny", 1, false, 4, 2},  // over 2 expert-parallel ranks
      {1, 2, 1, "1f1b", "none", 2, "bf16"},
      {1, 1, 1, "1f1b", "none", 2, "fp32", "llama-tiny", 2},  // context parallelism: its ranks are replicas
      {1, 2, 1, "1f1b", "none", 2, "fp32", "gpt-tiny"},      // (tied embedding, one stage)
      {2, 2, 1, "1f1b", "none", 2, "fp32", "gpt-tiny"},      // (its copies on two stages)
      {2, 2, 1, "interleaved-1f1b", "none", 4, "fp32", "gpt-tiny"},
      {2, 2, 1, "zbv", "none", 4, "fp32", "gpt-tiny"},  // (both copies on stage 0, in its two chunks)
      {2, 2, 1, "dataflow", "none", 4, "fp32", "gpt-tiny"},  // (each replica's order its own: by chunks only)
  };
  for (const auto& l : layouts) {
    SCOPED_TRACE(name_of(l));
    auto zero1 = fsdp_job(l, "optimizer");
    if (l.c > 1) zero1.seq_len = 64;
    const auto want = actors_run(zero1);
    ASSERT_EQ(want.exit_code, 0) << want.error;
    for (const char* level : {"gradients", "parameters"})
      for (const char* unit : {"chunk", "block"}) {
        if (std::string(l.schedule) == "dataflow" && std::string(unit) == "block") continue;  // (refused)
        SCOPED_TRACE(std::string(level) + " by " + unit);
        auto c = zero1;
        c.shard = level;
        c.fsdp_unit = unit;
        const auto got = actors_run(c);
        ASSERT_EQ(got.exit_code, 0) << got.error;
        // By chunks, one chunk per stage: its gradients are reduced once a step, after its
        // last backward, as ZeRO-1's are: the same sums, bit for bit. Two (interleaved,
        // zbv): each run of a chunk's ops is reduced as the stage moves to the other chunk,
        // and the ranks' sums are added up, while ZeRO-1 sums all of a rank's micro-batches
        // first: another order of the same fp32 additions. By blocks: each backward's
        // blocks are reduced as it ends (a split backward's when the run ends), the same.
        const bool same_sums = std::string(unit) == "chunk" && c.chunks == 1;
        expect_close(got, want, same_sums ? 0.0 : 1e-6);
      }
  }
}

// Hybrid sharding (parallel.shard_group): shard groups of g replicas, replicated across
// the groups, at every level, against ZeRO-1 over the whole group. A piece's gradients are
// summed within its shard group and then across the groups (transport/hybrid.hpp), ZeRO-1
// sums the d ranks in one ring: another order of the same fp32 additions (and of the
// gradient norm's partials), hence 1e-6 and not 0.
TEST(FsdpActors, HybridShardGroupsFollowZeRO1) {
  struct hybrid_case {
    fsdp_layout l;
    int g;
  };
  const hybrid_case cases[] = {
      {{1, 4, 1, "1f1b", "none"}, 2},
      {{2, 4, 1, "zero-bubble", "none"}, 2},
      {{1, 2, 1, "1f1b", "none"}, 1},  // every replica holds the whole state (DDP's layout)
      {{1, 2, 2, "1f1b", "none"}, 1},  // with tensor parallelism: per tensor-parallel rank
      // Experts over 2 expert-parallel ranks: each shard group holds an expert-parallel
      // group, its share of the experts sharded over the share's ranks in the group (1 of
      // the 2 expert-data-parallel ranks at d = 4, g = 2; 2 of 4 at d = 8, g = 4).
      {{1, 4, 1, "1f1b", "none", 2, "fp32", "llama-tiny", 1, false, 4, 2}, 2},
      {{1, 8, 1, "1f1b", "none", 2, "fp32", "llama-tiny", 1, false, 4, 2}, 4},
      // Context parallelism: groups of 2 of the D x C = 4 ranks (a replica's two halves
      // of each sequence shard the state; the other replica holds the same).
      {{1, 2, 1, "1f1b", "none", 2, "fp32", "llama-tiny", 2}, 2},
  };
  for (const auto& [l, g] : cases) {
    SCOPED_TRACE(name_of(l) + "_g" + std::to_string(g));
    const auto want = actors_run(fsdp_job(l, "optimizer"));
    ASSERT_EQ(want.exit_code, 0) << want.error;
    for (const char* level : {"optimizer", "gradients", "parameters"}) {
      SCOPED_TRACE(level);
      auto c = fsdp_job(l, level);
      c.shard_group = g;
      const auto got = actors_run(c);
      ASSERT_EQ(got.exit_code, 0) << got.error;
      expect_close(got, want, 1e-6);
      // Not the same run: the two-level sum is another order (a test that cannot tell
      // the layouts apart would pass with any shard_group).
      if (l.d * l.c >= 4) {
        EXPECT_GT(test::max_abs_diff(got.final_state, want.final_state), 0.0);
      }
    }
  }
}

TEST(FsdpActors, HybridShardedRunsCheckpointResumeAndRetryInPlace) {
  // Parameters sharded over groups of 2 of 4 replicas: the folder equals --save and the
  // run's final state and resumes with ZeRO-1 on two replicas; a rank of the second
  // group that throws is retried in place, bit-identically.
  auto c = fsdp_job({1, 4, 1, "1f1b", "none"}, "parameters");
  c.shard_group = 2;
  expect_resumed(c, {{2, "optimizer"}});
  expect_retried_in_place(c, "3:0:1");  // replica 3 (the second group's second rank), stage 0, step 2
  // With experts over 2 expert-parallel ranks: only the first group's shards write, and
  // their pieces hold every expert.
  c = fsdp_job({1, 4, 1, "1f1b", "none", 2, "fp32", "llama-tiny", 1, false, 4, 2}, "parameters");
  c.shard_group = 2;
  expect_resumed(c, {{2, "optimizer"}});
  expect_retried_in_place(c, "2:0:1");
}

TEST(FsdpActors, ShardedCheckpointFoldersResumeInOtherLayoutsAndLevels) {
  // Parameters sharded: the shards hold the only copy; the folder replica 0's stages
  // write from their shards' pieces equals what --save writes, and resumes with ZeRO-1
  // on one replica and with parameters sharded over 4.
  expect_resumed(fsdp_job({2, 2, 1, "1f1b", "none"}, "parameters"), {{1, "optimizer"}, {4, "parameters"}});
}

TEST(FsdpActors, EveryShardWritesItsPiecesOfTheCheckpointFolder) {
  // Tensor (and sequence) parallelism, experts over 2 expert-parallel ranks, bf16: each
  // shard writes its pieces (no stage gathers them); the folder equals --save and
  // resumes in another layout.
  struct sharded_case {
    fsdp_layout l;
    std::vector<std::pair<int, const char*>> others;
  };
  const sharded_case cases[] = {
      {{1, 2, 2, "1f1b", "none", 2, "fp32", "llama-tiny", 1, true}, {{1, "optimizer"}}},
      {{1, 4, 1, "1f1b", "none", 2, "fp32", "llama-tiny", 1, false, 4, 2}, {{2, "parameters"}}},
      {{1, 2, 1, "1f1b", "none", 2, "bf16"}, {{1, "optimizer"}}},
  };
  for (const auto& [l, others] : cases) {
    SCOPED_TRACE(name_of(l));
    expect_resumed(fsdp_job(l, "parameters"), others);
  }
  // A folder whose manifest leaves out a shard's file (and the file itself) is refused,
  // naming what its pieces lack, not read with zeros in its place.
  test::temp_dir dir;
  auto c = fsdp_job({1, 2, 1, "1f1b", "none"}, "parameters");
  c.steps = 2;
  c.checkpoint_dir = dir / "ckpt";
  ASSERT_EQ(actors_run(c).exit_code, 0);
  const std::string folder = dir / "ckpt/step-00000002";
  read_checkpoint_dir(folder, c);  // whole
  std::ifstream in(folder + "/manifest.json");
  auto manifest = nlohmann::json::parse(in);
  in.close();
  auto& files = manifest.at("files");
  files.erase(std::remove_if(files.begin(), files.end(),
                             [](const nlohmann::json& f) { return f.at("name") == "stage-0-shard-1.pt"; }),
              files.end());
  ASSERT_EQ(files.size(), 1u);
  std::filesystem::remove(folder + "/stage-0-shard-1.pt");
  std::ofstream(folder + "/manifest.json") << manifest.dump(2);
  try {
    read_checkpoint_dir(folder, c);
    ADD_FAILURE() << "a folder without one shard's file was read";
  } catch (const checkpoint_error& e) {
    EXPECT_NE(std::string(e.what()).find("its shard files lack elements"), std::string::npos) << e.what();
  }
}

TEST(FsdpActors, ARankThatFailsMidStepIsRetriedInPlaceBitIdentically) {
  // Replica 1's stage 0 throws in step 2 while replica 0's waits for it in a gather: the
  // group is failed, every actor rebuilt from the snapshots (the stages take their
  // pieces again from the gathered parameters), the step run again.
  expect_retried_in_place(fsdp_job({2, 2, 1, "1f1b", "none"}, "parameters"), "1:0:1");
}

namespace {

/// The trace events of `r` named `name`.
std::int64_t events_named(const actor_run_result& r, const std::string& name) {
  return std::count_if(r.events.begin(), r.events.end(), [&](const trace_event& e) { return e.name == name; });
}

/// `c` for 3 steps with the gathers' prefetch and without: the same bits; the all-gathers
/// of each (prefetched, at once) named in its trace. None is prefetched without it.
struct prefetch_runs {
  std::int64_t ahead_prefetched = 0, ahead_at_once = 0, at_once = 0;
};
prefetch_runs run_with_and_without_prefetch(job_config c) {
  c.steps = 3;
  const auto ahead = actors_run(c);
  c.fsdp_prefetch = false;
  const auto at_once = actors_run(c);
  expect_same_bits(ahead, at_once);
  EXPECT_EQ(events_named(at_once, "fsdp prefetched all-gather"), 0);
  return {events_named(ahead, "fsdp prefetched all-gather"), events_named(ahead, "fsdp all-gather"),
          events_named(at_once, "fsdp all-gather")};
}

}  // namespace

// parallel.fsdp_prefetch: a chunk's all-gather starts one op ahead (at begin_step for the
// step's first op, else as the op before it starts). The same gathers, started earlier:
// the same bits, as many all-gathers, and the prefetched ones named so in the trace.
TEST(FsdpActors, PrefetchStartsTheNextChunksGatherOneOpAhead) {
  auto c = fsdp_job({2, 2, 1, "interleaved-1f1b", "none", 4, "fp32", "gpt-tiny"}, "parameters");
  c.fsdp_unit = "chunk";
  const auto n = run_with_and_without_prefetch(c);
  // Every gather of a run of ops on a chunk is prefetched: each stage's step starts on a
  // chunk (prefetched at begin_step), and every switch to the other chunk is one op ahead.
  EXPECT_EQ(n.ahead_at_once, 0);
  EXPECT_EQ(n.ahead_prefetched, n.at_once);
  EXPECT_GT(n.ahead_prefetched, 0);
}

// By blocks: a block's gather starts as the block before it (in the forward; after it, in
// the backward) begins, and a chunk's first block and its rest as the op before starts.
// The same bits; no fewer gathers; most of them prefetched.
TEST(FsdpActors, ByBlocksPrefetchStartsTheNextBlocksGatherAsOneComputes) {
  auto c = fsdp_job({2, 2, 1, "1f1b", "none", 4, "fp32", "llama-tiny"}, "parameters");
  c.layers = 6;  // three blocks a stage
  const auto n = run_with_and_without_prefetch(c);
  // Without prefetch: per op, each block's gather (forward and backward alike) and the
  // rest's; a run of a chunk's ops keeps the rest, so 2 x 4 micro-batches x 3 blocks
  // gathers of blocks per stage actor and step (4 actors, 3 steps), and at least one of
  // the rest.
  EXPECT_GE(n.at_once, 3 * 4 * (2 * 4 * 3 + 1));
  EXPECT_GE(n.ahead_prefetched + n.ahead_at_once, n.at_once);
  // Prefetched: every block after an op's first (two of an op's three).
  EXPECT_GE(n.ahead_prefetched, 3 * 4 * 2 * 4 * 2);
}

TEST(FsdpConfig, RefusesWhatCannotWork) {
  auto base = fsdp_job({1, 2, 1, "1f1b", "none"}, "parameters");
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
  refused([](job_config& c) { c.shard = "everything"; }, "one of optimizer (ZeRO-1), gradients (ZeRO-2), parameters");
  refused([](job_config& c) { c.fsdp_unit = "layer"; }, "fsdp_unit 'layer': one of block");
  refused([](job_config& c) { c.shard_group = 3; }, "shard_group 3 must divide the 2 data-parallel ranks");
  refused([](job_config& c) { c.shard = "optimizer"; c.shard_group = 1; c.runtime = "local"; }, "runs in the actor runtime");
  refused([](job_config& c) { c.shard = "optimizer"; c.shard_group = 1; c.device = "cuda"; }, "point-to-point by tag");
  refused([](job_config& c) { c.shard = "optimizer"; c.shard_group = 1; c.experts = 4; c.moe_top_k = 1; c.expert_parallel = 2; },
          "expert_parallel must divide shard_group x tensor_parallel");
  refused([](job_config& c) { c.runtime = "local"; }, "runs in the actor runtime");
  refused([](job_config& c) { c.schedule = "dataflow"; }, "pair up only once a step: fsdp_unit chunk");
  refused([](job_config& c) { c.device = "cuda"; }, "not yet on its CUDA stream");
  base.validate();
  auto dataflow = base;  // (by chunks: the replicas meet once a step)
  dataflow.schedule = "dataflow";
  dataflow.fsdp_unit = "chunk";
  dataflow.validate();
  base.shard_group = 2;  // the whole group, said explicitly
  base.validate();
  base.shard_group = 1;  // hybrid: groups of one, replicated twice
  base.validate();
}

}  // namespace troupe
