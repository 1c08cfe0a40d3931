// The actor runtime: what a node keeps, checksums, gradient buckets and interleaved
// chunks reduced during the backward, in-flight bounds, reset checks, the trace file,
// resume, bad input, NaN losses; failures end the run with a clear error.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>

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

// A node process keeps of the initial (or resumed) model and moments only what its own
// stages' slices take: with 2 chunks, stage 1 of p2 holds blocks 2-3 and 6-7 of
// gpt-tiny's 8, the final layer norm and its copy of the tied embedding.
TEST(ActorRuntime, ANodeKeepsOnlyItsStagesParameters) {
  auto c = test::gpt_config(2);
  c.pipeline = 2;
  c.chunks = 2;
  c.schedule = "interleaved-1f1b";
  runtime_context ctx(c);
  const auto all = ctx.init;
  for (const auto& [name, t] : all) {
    ctx.resume_optim["exp_avg." + name] = t;
    ctx.resume_optim["exp_avg_sq." + name] = t;
  }
  ctx.keep_only({{0, 1}, {1, 1}});  // stage 1 of both replicas
  std::set<std::string> kept, expected{"wte.weight", "ln_f.weight", "ln_f.bias"};
  for (const auto& [name, t] : ctx.init) kept.insert(name);
  for (const auto& [name, t] : all)
    for (const char* block : {"h.2.", "h.3.", "h.6.", "h.7."})
      if (name.rfind(block, 0) == 0) expected.insert(name);
  EXPECT_EQ(kept, expected);
  EXPECT_EQ(ctx.resume_optim.size(), 2 * expected.size());
  for (const auto& name : expected) EXPECT_EQ(ctx.resume_optim.count("exp_avg_sq." + name), 1u) << name;
  // Its slices build from what it kept.
  for (int chunk = 0; chunk < 2; ++chunk)
    EXPECT_NO_THROW(make_slice(ctx.spec, ctx.ranges.at(chunk * 2 + 1), ctx.init, 1)) << chunk;
}

// Resuming, a node process reads the checkpoint folder file by file and keeps its share
// as it reads (runtime_context's slots): the same tensors keep_only leaves of the whole.
TEST(ActorRuntime, ANodeResumesOnlyItsStagesShareOfACheckpoint) {
  test::temp_dir dir;
  auto c = test::gpt_config(2);
  c.pipeline = 2;
  c.data_parallel = 2;
  c.checkpoint_dir = dir / "ck";
  const auto written = run_actors(c);
  ASSERT_EQ(written.exit_code, 0) << written.error;
  c.resume = c.checkpoint_dir;
  const std::vector<std::pair<int, int>> slots{{1, 0}};  // stage 0 of replica 1
  runtime_context whole(c);
  ASSERT_EQ(whole.init.size(), written.final_state.size());
  whole.keep_only(slots);
  const runtime_context node(c, nullptr, slots);
  EXPECT_EQ(node.start_step, 2);
  ASSERT_EQ(node.init.size(), whole.init.size());
  EXPECT_LT(node.init.size(), written.final_state.size());
  for (std::size_t i = 0; i < node.init.size(); ++i) {
    EXPECT_EQ(node.init[i].first, whole.init[i].first);
    EXPECT_TRUE(torch::equal(node.init[i].second, whole.init[i].second)) << node.init[i].first;
  }
  ASSERT_EQ(node.resume_optim.size(), whole.resume_optim.size());
  for (const auto& [name, t] : whole.resume_optim) {
    ASSERT_EQ(node.resume_optim.count(name), 1u) << name;
    EXPECT_TRUE(torch::equal(node.resume_optim.at(name), t)) << name;
  }
  // Its one shard restores from the moments; then they are let go.
  std::size_t seen = 0;
  node.with_resume_moments([&](const std::map<std::string, torch::Tensor>& moments) { seen = moments.size(); });
  EXPECT_EQ(seen, whole.resume_optim.size());
  EXPECT_TRUE(node.resume_optim.empty());
  // Without slots every shard of the job (p x d) restores before they go.
  for (int shard = 0; shard < 3; ++shard) whole.with_resume_moments([](const auto&) {});
  EXPECT_FALSE(whole.resume_optim.empty());
  whole.with_resume_moments([](const auto&) {});
  EXPECT_TRUE(whole.resume_optim.empty());
}

TEST(ActorRuntime, ChecksummedPayloadsGiveTheSameResult) {
  auto c = gpt_layout({2, 1, 1, "1f1b"});
  c.steps = 2;
  const auto plain = run_actors(c);
  c.checksum = true;
  const auto checked = run_actors(c);
  ASSERT_EQ(checked.exit_code, 0) << checked.error;
  EXPECT_EQ(test::max_abs_diff(checked.final_state, plain.final_state), 0.0);
}

// Interleaved schedules: a stage hands each chunk's gradient buffer to its shard as soon
// as that chunk's backwards are done (one bucket: when the last backward has accumulated
// its last gradient), and the shard reduce-scatters it while the stage still computes the
// other chunk's backwards (on stage 0 chunk 1 finishes first; the last stage's chunk 1
// holds the tied embedding and waits for stage 0's gradient of it). One reduce-scatter
// per chunk, of that chunk's buffer.
TEST(ActorRuntime, InterleavedChunksReduceScatterWhileTheOtherChunkComputes) {
  auto c = gpt_layout({2, 2, 2, "interleaved-1f1b"});
  c.steps = 3;
  const auto got = run_actors(c);
  ASSERT_EQ(got.exit_code, 0) << got.error;
  const auto ranges = partition_layers(c.model().n_layers(), c.pipeline * c.chunks);
  int overlapped = 0;  // (step, replica) pairs whose chunk 1 reduce-scatter began before stage 0's last op ended
  for (std::int64_t step = 0; step < c.steps; ++step)
    for (int r = 0; r < c.data_parallel; ++r) {
      double last_op_end = 0, chunk1_last = 0;  // stage 0: the end of its last op, the start of chunk 1's last
      std::map<std::pair<int, int>, const trace_event*> rs;  // (stage, chunk)
      for (const auto& e : got.events) {
        if (e.step != step || e.replica != r) continue;
        if ((e.name == "F" || e.name == "B") && e.stage == 0) {
          last_op_end = std::max(last_op_end, e.end_us);
          if (e.chunk == 1) chunk1_last = std::max(chunk1_last, e.start_us);
        }
        if (e.name == "reduce-scatter") {
          EXPECT_FALSE(rs.count({e.stage, e.chunk})) << "two reduce-scatters of stage " << e.stage << " chunk " << e.chunk;
          rs[{e.stage, e.chunk}] = &e;
        }
      }
      ASSERT_EQ(rs.size(), 4u) << "step " << step << ": a reduce-scatter per stage and chunk";
      for (const auto& [where, e] : rs) {
        const auto slice = make_slice(c.model(), ranges[where.second * c.pipeline + where.first],
                                      initial_state(c.model(), 1), c.data_parallel);
        EXPECT_EQ(e->bytes, std::int64_t(slice->flat_grads().nbytes())) << "stage " << where.first << " chunk " << where.second;
      }
      const auto& early = *rs.at({0, 1});
      EXPECT_GE(early.start_us, chunk1_last) << "chunk 1's reduce-scatter began before its last backward";
      overlapped += early.start_us < last_op_end;
      EXPECT_GE(rs.at({0, 0})->start_us, last_op_end);
    }
  // The shard starts chunk 1's reduce-scatter as soon as it has the buckets, while stage 0
  // runs its chunk 0 ops. On a loaded machine (the suite's entries side by side) the shard
  // can be scheduled after the stage's last op in a step: not in every one of them.
  EXPECT_GE(overlapped, 1) << "stage 0's chunk 1 was reduce-scattered only after every op, in every step";
}

// Gradient buckets (v = 1): the step's last backward hands each bucket to the shard as
// soon as it has accumulated the bucket's gradients, and the shard reduce-scatters it
// while that backward goes on (Megatron's overlapped gradient reduction). One
// reduce-scatter per bucket, of the bucket's bytes; the parameters are bit-identical to
// those of one bucket (d = 2: each element is the sum of the same two values).
TEST(ActorRuntime, GradientBucketsReduceScatterDuringTheLastBackward) {
  auto c = gpt_layout({2, 2, 1, "1f1b"});
  c.steps = 3;
  const auto whole = run_actors(c);
  ASSERT_EQ(whole.exit_code, 0) << whole.error;
  c.bucket_size = 20000;
  const auto got = run_actors(c);
  ASSERT_EQ(got.exit_code, 0) << got.error;
  EXPECT_EQ(test::max_abs_diff(got.final_state, whole.final_state), 0.0);
  EXPECT_EQ(got.losses, whole.losses);
  const auto ranges = partition_layers(c.model().n_layers(), c.pipeline);
  for (int k = 0; k < c.pipeline; ++k) {
    const auto slice = make_slice(c.model(), ranges[k], initial_state(c.model(), 1), c.data_parallel);
    const auto buckets = grad_buckets(slice->entries(), slice->flat_grads().numel(), c.data_parallel, c.bucket_size);
    ASSERT_GT(buckets.size(), 3u);
    int early = 0, total = 0;
    for (std::int64_t step = 0; step < c.steps; ++step)
      for (int r = 0; r < c.data_parallel; ++r) {
        const trace_event* last_b = nullptr;
        std::map<int, const trace_event*> rs;  // by bucket
        for (const auto& e : got.events) {
          if (e.step != step || e.replica != r || e.stage != k) continue;
          if (e.name == "B" && (!last_b || e.start_us > last_b->start_us)) last_b = &e;
          if (e.name == "reduce-scatter") {
            EXPECT_FALSE(rs.count(e.mb)) << "bucket " << e.mb << " reduce-scattered twice";
            rs[e.mb] = &e;
          }
        }
        ASSERT_TRUE(last_b);
        ASSERT_EQ(rs.size(), buckets.size()) << "step " << step << " stage " << k << ": one reduce-scatter per bucket";
        for (const auto& [b, e] : rs) {
          EXPECT_EQ(e->bytes, buckets.at(b).size() * std::int64_t(sizeof(float)));
          EXPECT_GE(e->start_us, last_b->start_us) << "bucket " << b << " reduce-scattered before the last backward";
          early += e->start_us < last_b->end_us;
          ++total;
        }
      }
    // Most buckets start while the backward runs (but for thread scheduling on a busy
    // machine); without the watch all would start after it.
    EXPECT_GT(early, 0) << "stage " << k << ": every bucket was reduce-scattered only after the last backward ("
                        << total << " buckets)";
    std::printf("stage %d: %d of %d bucket reduce-scatters began during the last backward\n", k, early, total);
  }
}

TEST(ActorRuntime, FmnistMlpEqualsTheReferenceLoop) {
  auto c = job_config::defaults_for("fmnist-mlp");
  c.steps = kSteps;
  const auto ref = reference_of(c);
  c.pipeline = 2;
  c.data_parallel = 2;
  c.microbatches = 2;
  c.threads = 2;  // the reference's intra-op threads: BLAS sums in the same order
  const auto got = run_actors(c);
  ASSERT_EQ(got.exit_code, 0) << got.error;
  EXPECT_LE(test::max_abs_diff(got.final_state, ref.state), 1e-5);
  for (int i = 0; i < kSteps; ++i) EXPECT_NEAR(got.losses[i], ref.losses[i], 1e-5);
}

TEST(ActorRuntime, DataflowRespectsItsInFlightBound) {
  for (const bool split : {false, true}) {
    auto c = gpt_layout({4, 1, 1, "dataflow", split});
    c.max_in_flight = 2;
    c.steps = 3;
    const auto got = run_actors(c);
    ASSERT_EQ(got.exit_code, 0) << got.error;
    int worst = 0;
    for (std::int64_t s = 0; s < 3; ++s)
      for (const auto& [track, order] : executed(got.events, s)) {
        int live = 0, forwards = 0;
        for (const auto& op : order) {
          // A W runs only when it is due: the bound holds the next forward back, or the
          // stage has no forward left.
          if (op.kind == op_kind::weight) {
            EXPECT_TRUE(live >= 2 || forwards == c.microbatches)
                << "W" << op.mb << " ran with " << live << " in flight after " << forwards << " forwards";
          }
          if (op.kind == op_kind::forward) ++live, ++forwards;
          if (op.kind == (split ? op_kind::weight : op_kind::backward)) --live;
          worst = std::max(worst, live);
        }
        EXPECT_EQ(live, 0);
        EXPECT_EQ(order.size(), (split ? 3u : 2u) * c.microbatches);
      }
    EXPECT_LE(worst, 2) << "split " << split;
    EXPECT_EQ(worst, 2) << "split " << split << ": the bound should be reached with 8 micro-batches";
  }
}

TEST(ActorRuntime, OneFOneBHoldsAtMostPMinusRActivations) {
  auto c = gpt_layout({4, 1, 1, "1f1b"});
  c.steps = 2;
  const auto got = run_actors(c);
  ASSERT_EQ(got.exit_code, 0) << got.error;
  for (const auto& [track, order] : executed(got.events, 1)) {
    int live = 0, worst = 0;
    for (const auto& op : order) worst = std::max(worst, live += op.kind == op_kind::forward ? 1 : -1);
    EXPECT_EQ(worst, 4 - track.second);
  }
}

TEST(ActorRuntime, LeftoverStateAfterResetIsReported) {
  auto c = gpt_layout({2, 1, 1, "1f1b"});
  c.steps = 4;
  actor_run_options opts;
  opts.plant_leftover = actor_run_options::leftover_plant{0, 1, 1};  // a stray tensor in stage 1's buffers during step 1
  const auto got = run_actors(c, opts);
  EXPECT_EQ(got.exit_code, 1);
  EXPECT_NE(got.error.find("stage[replica 0, stage 1]: 1 buffered input(s)"), std::string::npos) << got.error;
  EXPECT_EQ(got.losses.size(), 2u) << "step 1 commits, then fails its reset check";
}

TEST(ActorRuntime, ActorThatThrowsAbortsTheStepWithinBoundedTime) {
  auto c = gpt_layout({2, 1, 1, "1f1b"});
  c.steps = 5;
  c.throw_at = "0:1:2";
  c.step_timeout = 30;
  c.max_step_retries = 0;  // no in-place retry: the run ends (tests/faults/recovery_test.cpp retries)
  const auto t0 = std::chrono::steady_clock::now();
  const auto got = run_actors(c);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(got.exit_code, exit_recoverable);  // a restart from a checkpoint can cure it
  EXPECT_NE(got.error.find("step 3/5 aborted"), std::string::npos) << got.error;
  EXPECT_NE(got.error.find("stage[replica 0, stage 1]"), std::string::npos) << got.error;
  EXPECT_NE(got.error.find("injected fault"), std::string::npos) << got.error;
  EXPECT_EQ(got.losses.size(), 2u);
  EXPECT_LT(seconds, 20.0);
}

TEST(ActorRuntime, TraceFileHasOneTrackPerStageAndReadableArgs) {
  test::temp_dir dir;
  auto c = gpt_layout({2, 2, 1, "1f1b"});
  c.steps = 2;
  c.trace = dir / "trace.json";
  c.checkpoint_dir = dir / "ck";
  c.checkpoint_interval = 1;
  const auto got = run_actors(c);
  ASSERT_EQ(got.exit_code, 0) << got.error;
  std::ifstream in(c.trace);
  const auto trace = nlohmann::json::parse(in);
  std::set<std::pair<int, int>> tracks;
  int compute = 0, idle = 0, sends = 0, recvs = 0, evals = 0;
  // The checkpoints: on replica 0's stage tracks, each stage's fetch of its shards' state
  // and its writes, with the bytes of its files (the newest checkpoint's manifest).
  std::map<std::string, int> checkpoint_events;
  std::map<int, std::int64_t> written;   // stage: bytes of its files after step 2
  std::map<int, std::int64_t> gathered;  // stage: bytes its 2 shards sent it then
  std::ifstream manifest_in(dir / "ck/step-00000002/manifest.json");
  const auto manifest = nlohmann::json::parse(manifest_in);
  std::map<int, std::int64_t> manifest_bytes;
  for (const auto& f : manifest["files"]) manifest_bytes[f["stage"]] += f["bytes"].get<std::int64_t>();
  for (const auto& e : trace["traceEvents"]) {
    if (e.value("cat", "") == "comm") {  // tensor messages between stages, on the stage tracks
      const std::string name = e["name"];
      (name.rfind("send ", 0) == 0 ? sends : recvs) += 1;
      EXPECT_EQ(e["ph"], name.rfind("send ", 0) == 0 ? "X" : "i") << name;
      for (const char* key : {"step", "stage", "mb", "chunk", "replica"}) EXPECT_TRUE(e["args"].contains(key)) << key;
      if (name == "send activation") {
        EXPECT_EQ(e["tid"], 0) << "activations leave stage 0 only (p = 2)";
      }
      if (name == "recv activation") {
        EXPECT_EQ(e["tid"], 1);
      }
    }
    if (e["ph"] != "X") continue;
    if (e["cat"] == "compute") {
      ++compute;
      const auto& a = e["args"];
      for (const char* key : {"step", "stage", "op", "mb", "chunk", "replica"}) EXPECT_TRUE(a.contains(key)) << key;
      EXPECT_TRUE(a["op"] == "F" || a["op"] == "B");
      tracks.insert({e["pid"].get<int>(), e["tid"].get<int>()});
    }
    idle += e["cat"] == "idle";
    if (e["cat"] == "checkpoint") {
      ++checkpoint_events[e["name"]];
      EXPECT_EQ(e["pid"], 0);
      EXPECT_GT(e["args"]["bytes"].get<std::int64_t>(), 0);
      if (e["name"] == "checkpoint write" && e["args"]["step"] == 1) written[e["tid"]] = e["args"]["bytes"];
      if (e["name"] == "checkpoint gather" && e["args"]["step"] == 1) gathered[e["tid"]] = e["args"]["bytes"];
    }
    if (e["cat"] == "evaluation") {  // the final evaluation: one forward (replica 0), through both stages
      ++evals;
      EXPECT_EQ(e["pid"], 0);
      EXPECT_EQ(e["name"], "eval F0");
      for (const char* key : {"step", "stage", "forward", "chunk", "replica"}) EXPECT_TRUE(e["args"].contains(key)) << key;
    }
  }
  EXPECT_EQ(evals, 2);
  // Step 1's folder in the background (a snapshot per stage first), step 2's (the run's
  // last) synchronously.
  EXPECT_EQ(checkpoint_events, (std::map<std::string, int>{
                                   {"checkpoint gather", 4}, {"checkpoint snapshot", 2}, {"checkpoint write", 4}}));
  EXPECT_EQ(written, manifest_bytes);
  // Each shard sent only its own elements: the stage got both fp32 moments once.
  for (int k = 0; k < 2; ++k) {
    std::int64_t numel = 0;
    for (const auto& [name, t] : load_state_dict(dir / ("ck/step-00000002/stage-" + std::to_string(k) + ".pt")))
      numel += t.numel();
    EXPECT_EQ(gathered[k], 2 * 4 * numel) << "stage " << k;
  }
  EXPECT_EQ(compute, 2 * 2 * 2 * 2 * c.microbatches);  // steps x replicas x stages x (F + B)
  // Per step and replica: m activations, m gradients and the two tied-embedding gradients.
  EXPECT_EQ(sends, 2 * 2 * (2 * c.microbatches + 2));
  EXPECT_EQ(recvs, sends);
  EXPECT_EQ(tracks.size(), 4u);
  EXPECT_GT(idle, 0);
  for (double b : got.bubbles) {
    EXPECT_GE(b, 0.0);
    EXPECT_LT(b, 1.0);
  }
}

TEST(ActorRuntime, ResumeFromCheckpointIsBitIdentical) {
  test::temp_dir dir;
  auto c = gpt_layout({2, 2, 1, "1f1b"});
  c.steps = 6;
  const auto straight = run_actors(c);
  ASSERT_EQ(straight.exit_code, 0) << straight.error;
  // The same six-step run, checkpointed every 3 steps and cut by a fault inside step 3
  // (0-based), right after the checkpoint of the first three steps was written.
  auto first = c;
  first.save = dir / "ckpt.pt";
  first.checkpoint_interval = 3;
  first.throw_at = "0:0:3";  // stops the run inside step 3, after the checkpoint of step 3
  first.max_step_retries = 0;
  const auto cut = run_actors(first);
  ASSERT_EQ(cut.exit_code, exit_recoverable);
  ASSERT_EQ(cut.losses.size(), 3u);
  auto resumed_cfg = c;
  resumed_cfg.load = dir / "ckpt.pt";
  const auto resumed = run_actors(resumed_cfg);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.error;
  EXPECT_EQ(test::max_abs_diff(resumed.final_state, straight.final_state), 0.0);
  ASSERT_EQ(resumed.losses.size(), 3u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(resumed.losses[i], straight.losses[3 + i]);
  // The plain loop resumes the same checkpoint to within float reordering.
  auto local = resumed_cfg;
  local.runtime = "local";
  local_trainer t(local);
  EXPECT_EQ(t.next_step(), 3);
  while (t.next_step() < 6) t.step();
  EXPECT_LE(test::max_abs_diff(t.state(), straight.final_state), 1e-5);
}

TEST(ActorRuntime, BadInitialWeightsAreRefusedUpFront) {
  test::temp_dir dir;
  auto c = gpt_layout({2, 1, 1, "1f1b"});
  c.init = dir / "missing.pt";
  EXPECT_ANY_THROW(run_actors(c));
  // Weights of another shape ([model] keys): refused, naming what does not fit.
  save_state_dict(dir / "tiny.pt", initial_state(c.model(), 1));
  c.init = dir / "tiny.pt";
  c.layers = 2;
  c.d_model = 32;
  try {
    run_actors(c);
    ADD_FAILURE() << "the small gpt-tiny's weights were taken by a 2-layer, d_model 32 model";
  } catch (const std::exception& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("wte.weight has shape [256, 64], expected [256, 32]"), std::string::npos) << what;
    EXPECT_NE(what.find("wpe.weight has shape [64, 64], expected [64, 32]"), std::string::npos) << what;
  }
}

// The [model] keys: a model of another shape, pipelined and data-parallel, trains as the
// single-process loop does.
TEST(ActorRuntime, AnotherModelShapeEqualsTheReferenceLoop) {
  auto c = gpt_layout({3, 2, 1, "1f1b"});
  c.layers = 3;
  c.heads = 2;
  c.d_model = 32;
  c.d_ff = 80;
  c.seq_len = 48;
  c.validate();
  const auto ref = reference_of(c);
  const auto got = run_actors(c);
  ASSERT_EQ(got.exit_code, 0) << got.error;
  ASSERT_EQ(got.final_state.size(), ref.state.size());
  EXPECT_EQ(got.final_state.front().second.sizes(), (std::vector<std::int64_t>{256, 32}));  // wte
  EXPECT_LE(test::max_abs_diff(got.final_state, ref.state), 1e-5);
  for (int i = 0; i < kSteps; ++i) EXPECT_NEAR(got.losses[i], ref.losses[i], 1e-5) << "step " << i;
}

}  // namespace troupe

// A NaN loss (injected at step 1): the update is skipped (no parameter or AdamW change),
// the run goes on; beyond max_skipped_steps the run stops with a clear error.
TEST(ActorRuntime, NanLossSkipsTheUpdateUpToALimit) {
  auto cfg = troupe::test::gpt_config(2);
  cfg.pipeline = 2;
  cfg.data_parallel = 2;
  cfg.microbatches = 4;
  cfg.eval_interval = 0;
  troupe::actor_run_options quiet;
  quiet.quiet = true;
  auto one = cfg;
  one.steps = 1;  // warm-up lr does not depend on the run's length
  const auto reference = troupe::run_actor_training(one, quiet);
  ASSERT_EQ(reference.exit_code, 0) << reference.error;
  cfg.nan_at = 1;
  const auto skipped = troupe::run_actor_training(cfg, quiet);
  ASSERT_EQ(skipped.exit_code, 0) << skipped.error;
  ASSERT_EQ(skipped.losses.size(), 2u);
  EXPECT_TRUE(std::isfinite(skipped.losses[0]));
  EXPECT_TRUE(std::isnan(skipped.losses[1]));
  EXPECT_EQ(troupe::test::max_abs_diff(skipped.final_state, reference.final_state), 0.0);
  cfg.max_skipped_steps = 0;
  const auto stopped = troupe::run_actor_training(cfg, quiet);
  EXPECT_EQ(stopped.exit_code, 1);
  EXPECT_NE(stopped.error.find("gradients not finite"), std::string::npos) << stopped.error;
}
