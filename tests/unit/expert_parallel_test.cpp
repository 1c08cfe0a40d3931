// Expert parallelism (compute/parallel/expert_parallel.hpp): the all-to-all with per-rank sizes on
// every transport, a rank that receives no tokens, and training with EP ranks equal to
// one process, in the local loop and with the actor runtime's stage actors.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <numeric>
#include <set>
#include <thread>

#include <nlohmann/json.hpp>

#include "actor_test_util.hpp"
#include "actors/tp_groups.hpp"
#include "compute/checkpoint/checkpoint.hpp"
#include "compute/checkpoint/checkpoint_dir.hpp"
#include "compute/parallel/expert_parallel.hpp"
#include "compute/trainer/local_trainer.hpp"
#include "test_util.hpp"
#include "ucx_groups.hpp"

namespace troupe {

namespace {

/// Runs fn(rank) for every member of `groups` on a thread of its own.
void on_threads(int n, const std::function<void(int)>& fn) {
  std::vector<std::thread> ts;
  for (int r = 0; r < n; ++r) ts.emplace_back(fn, r);
  for (auto& t : ts) t.join();
}

job_config moe_job() {
  auto c = job_config::defaults_for("moe-tiny");
  c.steps = 10;
  c.device = "cpu";
  c.runtime = "local";
  c.layers = 2;
  c.d_model = 32;
  c.heads = 4;
  c.kv_heads = 2;
  c.moe_d_ff = 48;
  c.seq_len = 16;
  c.global_batch = 8;
  c.microbatches = 2;
  c.eval_interval = 0;
  return c;
}

struct run {
  std::vector<double> losses, aux;
  std::vector<expert_counts> routed;  ///< per step
  state_dict state;
};

run train(const job_config& c, const group_factory& groups = in_process_groups) {
  local_trainer t(c, std::nullopt, groups);
  run out;
  for (int i = 0; i < c.steps; ++i) {
    const auto st = t.step();
    out.losses.push_back(st.loss);
    out.aux.push_back(st.aux_loss);
    out.routed.push_back(st.expert_tokens);
  }
  out.state = t.state();
  return out;
}

/// How many routing decisions differ between two runs' counts at least: half the summed
/// differences of the per-expert counts (a near-tie flipped by a reordered sum moves one
/// (token, choice) pair: 1; a bug moves many). Reported where a layout's routing differs.
std::int64_t routing_differences(const expert_counts& got, const expert_counts& ref) {
  std::int64_t moved = 0;
  for (const auto& [layer, counts] : ref) {
    const auto it = got.find(layer);
    for (std::size_t e = 0; e < counts.size(); ++e)
      moved += std::abs((it == got.end() || e >= it->second.size() ? 0 : it->second[e]) - counts[e]);
  }
  return (moved + 1) / 2;
}

/// Of the overlapped pairs (F&B) of steps 0 and steps - 1 on every stage of `replicas`
/// replicas: how many there are, and in how many an all-to-all of one op (its
/// micro-batch and chunk, within its span) started while the other op ran.
std::pair<int, int> overlapped_pairs(const std::vector<trace_event>& events, const schedule& sched, int replicas,
                                     int steps) {
  int pairs = 0, overlapped = 0;
  for (const std::int64_t step : {std::int64_t(0), std::int64_t(steps - 1)})
    for (int r = 0; r < replicas; ++r)
      for (int k = 0; k < sched.stages; ++k) {
        auto span_of = [&](const pipeline_op& op) {
          for (const auto& e : events)
            if (e.step == step && e.replica == r && e.stage == k && e.mb == op.mb && e.chunk == op.chunk &&
                e.name == op_letter(op.kind))
              return std::make_pair(e.start_us, e.end_us);
          return std::make_pair(-1.0, -1.0);
        };
        // Whether an all-to-all of `op` (within its span `mine`) starts inside `other`.
        auto calls_during = [&](const pipeline_op& op, std::pair<double, double> mine,
                                std::pair<double, double> other) {
          for (const auto& e : events)
            if (e.name == "all-to-all" && e.step == step && e.replica == r && e.stage == k && e.mb == op.mb &&
                e.chunk == op.chunk && e.start_us >= mine.first && e.end_us <= mine.second &&
                e.start_us > other.first && e.start_us < other.second)
              return true;
          return false;
        };
        const auto& ops = sched.ranks[std::size_t(k)];
        for (std::size_t i = 0; i + 1 < ops.size(); ++i) {
          if (!ops[i].paired) continue;
          const auto f = span_of(ops[i]), b = span_of(ops[i + 1]);
          ++pairs;
          overlapped += calls_during(ops[i], f, b) || calls_during(ops[i + 1], b, f);
        }
      }
  return {pairs, overlapped};
}

/// An actor run's metrics log (`path`) against the plain loop's steps `ref`: per step the
/// loss within 1e-5, the load-balancing loss within 1e-6, the same fewest and most
/// (token, choice) pairs per expert layer; one line per step.
void expect_metrics_follow(const std::string& path, const std::vector<step_stats>& ref, const std::string& at) {
  std::ifstream metrics(path);
  std::size_t i = 0;
  for (std::string line; std::getline(metrics, line);) {
    const auto j = nlohmann::json::parse(line);
    if (!j.contains("loss")) continue;
    ASSERT_LT(i, ref.size()) << at;
    const auto& st = ref[i];
    EXPECT_NEAR(j.at("loss").get<double>(), st.loss, 1e-5) << at << " step " << i;
    EXPECT_NEAR(j.at("aux_loss").get<double>(), st.aux_loss, 1e-6) << at << " step " << i;
    const auto [fewest, most] = expert_token_range(st.expert_tokens);
    EXPECT_EQ(j.at("expert_tokens_min").get<std::vector<std::int64_t>>(), fewest) << at << " step " << i;
    EXPECT_EQ(j.at("expert_tokens_max").get<std::vector<std::int64_t>>(), most) << at << " step " << i;
    ++i;
  }
  EXPECT_EQ(i, ref.size()) << at;
}

}  // namespace

// Rank r sends (r + q) % 3 rows of two values to rank q (some none): each row says where
// it came from and went; every transport delivers them in source order.
TEST(ExpertParallel, AllToAllMovesUnevenRowsOnEveryTransport) {
  for (const auto& [name, make] : std::vector<std::pair<std::string, group_factory>>{
           {"in-process", in_process_groups}, {"ucx", test::ucx_groups}}) {
    const int n = 3;
    const auto groups = make(n);
    std::vector<torch::Tensor> got(n);
    on_threads(n, [&](int r) {
      std::vector<std::int64_t> send, recv;
      std::vector<torch::Tensor> rows;
      for (int q = 0; q < n; ++q) {
        send.push_back((r + q) % n);
        recv.push_back((q + r) % n);
        for (int i = 0; i < (r + q) % n; ++i) rows.push_back(torch::tensor({double(10 * r + q), double(i)}).view({1, 2}));
      }
      const auto in = rows.empty() ? torch::zeros({0, 2}, torch::kFloat64) : torch::cat(rows);
      got[std::size_t(r)] = groups[std::size_t(r)]->all_to_all(in, send, recv);
    });
    for (int r = 0; r < n; ++r) {
      std::vector<std::pair<double, double>> want;
      for (int s = 0; s < n; ++s)
        for (int i = 0; i < (s + r) % n; ++i) want.emplace_back(10 * s + r, i);
      const auto& t = got[std::size_t(r)];
      ASSERT_EQ(t.size(0), std::int64_t(want.size())) << name << " rank " << r;
      for (std::size_t i = 0; i < want.size(); ++i) {
        EXPECT_EQ(t[std::int64_t(i)][0].item<double>(), want[i].first) << name << " rank " << r;
        EXPECT_EQ(t[std::int64_t(i)][1].item<double>(), want[i].second) << name << " rank " << r;
      }
    }
  }
}

// A router with zero weights gives every expert the same probability: every token picks
// experts 0 and 1 (ties: the lower index), so with EP = 2 rank 1 (experts 2 and 3) receives
// no token. Both ranks' outputs and gradients equal the unsplit layer's; experts 2 and 3
// get no gradient anywhere.
TEST(ExpertParallel, ARankThatReceivesNoTokensWorks) {
  auto c = moe_job();
  c.validate();
  const auto spec = c.model();
  auto init = initial_state(spec, 3);
  for (auto& [name, t] : init)
    if (name.find("block_sparse_moe.gate") != std::string::npos) t.zero_();
  layer_range whole;
  whole.last = spec.n_layers();
  const auto tokens = torch::randint(0, 256, {2, 2, c.seq_len}, torch::kInt64);  // per rank
  auto one = make_slice(spec, whole, init);
  std::vector<torch::Tensor> want(2);
  for (int r = 0; r < 2; ++r) {
    auto loss = one->loss(one->forward(tokens[r]), tokens[r]);
    loss.backward();
    want[std::size_t(r)] = loss.detach();
  }
  const auto groups = in_process_groups(2);
  std::vector<std::unique_ptr<model_slice>> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.push_back(make_slice(spec, whole, init));
    ranks.back()->set_expert_parallel({r, 2, groups[std::size_t(r)]});
  }
  std::vector<torch::Tensor> got(2);
  on_threads(2, [&](int r) {
    auto& s = *ranks[std::size_t(r)];
    auto loss = s.loss(s.forward(tokens[r]), tokens[r]);
    loss.backward();
    got[std::size_t(r)] = loss.detach();
  });
  for (int r = 0; r < 2; ++r) EXPECT_LT((got[std::size_t(r)] - want[std::size_t(r)]).abs().item<double>(), 1e-6);
  // The gradients summed over the two ranks (what the optimizer sums over replicas) are
  // the unsplit layer's over both batches.
  const auto sum = ranks[0]->flat_grads() + ranks[1]->flat_grads();
  EXPECT_LT((sum - one->flat_grads()).abs().max().item<double>(), 1e-6);
  for (const auto& e : ranks[1]->entries())
    if (e.name.find("experts.2.") != std::string::npos || e.name.find("experts.3.") != std::string::npos) {
      EXPECT_EQ(ranks[0]->flat_grads().narrow(0, e.offset, e.numel).abs().sum().item<double>(), 0.0) << e.name;
      EXPECT_EQ(ranks[1]->flat_grads().narrow(0, e.offset, e.numel).abs().sum().item<double>(), 0.0) << e.name;
    }
  // Rank 0 computed expert 0 for both ranks' tokens; rank 1 none, yet it routed its own.
  auto grad_of = [&](int r, const std::string& part) {
    for (const auto& e : ranks[std::size_t(r)]->entries())
      if (e.name.find(part) != std::string::npos)
        return ranks[std::size_t(r)]->flat_grads().narrow(0, e.offset, e.numel).abs().sum().item<double>();
    return -1.0;
  };
  EXPECT_GT(grad_of(0, "layers.0.block_sparse_moe.experts.0.w1"), 0.0);
  EXPECT_EQ(grad_of(1, "layers.0.block_sparse_moe.experts.0.w1"), 0.0);
  EXPECT_GT(grad_of(1, "layers.0.block_sparse_moe.gate"), 0.0);
}

// Training: EP 2 and 4 over 4 replicas (with a pipeline, and with zero-bubble's split
// backward) follows one process within 1e-5 after kSteps steps, the load-balancing loss too;
// over UCX communicators the same bits as in process.
TEST(ExpertParallel, TrainingWithExpertRanksEqualsOneProcess) {
  auto one = moe_job();
  const auto ref = train(one);
  // The metrics' counts: every layer's pairs are k per token of the global batch, none
  // dropped (the last count).
  ASSERT_EQ(ref.routed.front().size(), std::size_t(one.layers));
  for (const auto& [layer, counts] : ref.routed.front()) {
    ASSERT_EQ(counts.size(), 5u);
    EXPECT_EQ(std::accumulate(counts.begin(), counts.end() - 1, std::int64_t(0)),
              std::int64_t(2) * one.global_batch * one.seq_len) << "layer " << layer;
    EXPECT_EQ(counts.back(), 0) << "layer " << layer;
  }
  struct layout {
    int ep, d, p;
    const char* schedule;
  };
  for (const auto& l : {layout{2, 2, 1, "1f1b"}, layout{4, 4, 1, "1f1b"}, layout{2, 4, 2, "1f1b"},
                        layout{2, 2, 2, "zero-bubble"}}) {
    auto c = one;
    c.expert_parallel = l.ep;
    c.data_parallel = l.d;
    c.pipeline = l.p;
    c.schedule = l.schedule;
    const auto got = train(c);
    const std::string at = "ep " + std::to_string(l.ep) + " d " + std::to_string(l.d) + " p " + std::to_string(l.p) +
                           " " + l.schedule;
    EXPECT_LE(test::max_abs_diff(got.state, ref.state), 1e-5) << at;
    for (int i = 0; i < one.steps; ++i) {
      EXPECT_NEAR(got.losses[std::size_t(i)], ref.losses[std::size_t(i)], 1e-5) << at << " step " << i;
      EXPECT_NEAR(got.aux[std::size_t(i)], ref.aux[std::size_t(i)], 1e-6) << at << " step " << i;
      // The same routing: every expert got the same (token, choice) pairs in every layer.
      EXPECT_EQ(got.routed[std::size_t(i)], ref.routed[std::size_t(i)])
          << at << " step " << i << ": routing decisions differed: "
          << routing_differences(got.routed[std::size_t(i)], ref.routed[std::size_t(i)]);
    }
  }
  auto c = one;
  c.expert_parallel = 2;
  c.data_parallel = 2;
  c.steps = 3;
  const auto over_ucx = train(c, test::ucx_groups), in_process = train(c);
  EXPECT_EQ(over_ucx.losses, in_process.losses);
  EXPECT_EQ(test::max_abs_diff(over_ucx.state, in_process.state), 0.0);
}

// Megatron's expert-data-parallel layout: each rank holds only its share of the experts
// (EP 4 over 4 replicas: one of the 4 experts of each layer), its buffers are the dense
// parameters and that one expert; the optimizer updates each expert on its own rank, and
// the model it gives back (and saves) is whole.
TEST(ExpertParallel, EachRankHoldsOnlyItsShareOfTheExperts) {
  auto one = moe_job();
  one.steps = 2;
  local_trainer single(one);
  const auto& whole = single.replica(0).slice(0);
  std::int64_t expert_elems = 0;
  for (const auto& e : whole.entries())
    if (expert_of(e.name) >= 0) expert_elems += e.numel;
  ASSERT_GT(expert_elems, whole.numel() / 2);  // (moe-tiny: most parameters are experts')
  auto c = one;
  c.expert_parallel = 4;
  c.data_parallel = 4;
  local_trainer t(c, std::nullopt, in_process_groups);
  for (int r = 0; r < 4; ++r) {
    const auto& slice = t.replica(r).slice(0);
    EXPECT_EQ(slice.numel(), whole.numel() - expert_elems * 3 / 4) << "replica " << r;
    for (const auto& e : slice.entries())
      if (expert_of(e.name) >= 0) EXPECT_EQ(expert_of(e.name), r) << e.name;
  }
  for (int i = 0; i < c.steps; ++i) {
    const auto a = t.step(), b = single.step();
    EXPECT_NEAR(a.loss, b.loss, 1e-5) << "step " << i;
  }
  const auto state = t.state();
  check_state(c.model(), state);
  EXPECT_LE(test::max_abs_diff(state, single.state()), 1e-5);
  // Each expert was updated where it lives: every expert moved from its initial values.
  const auto init = initial_state(c.model(), c.seed);
  const std::map<std::string, torch::Tensor> before(init.begin(), init.end());
  for (const auto& [name, p] : state)
    if (expert_of(name) >= 0) EXPECT_FALSE(p.equal(before.at(name))) << name;
  const auto optim = t.optimizer_state();
  for (const auto& [name, m] : optim)
    if (expert_of(name) >= 0) EXPECT_GT(m.abs().sum().item<double>(), 0.0) << name;
}

// A node process keeps of the initial state only what its pipelines hold: its share of the
// experts (pipeline q: share q mod EP), and the slices of its stages and shards build from
// it.
TEST(ExpertParallel, ANodeKeepsOnlyItsShareOfTheExperts) {
  auto c = moe_job();
  c.runtime = "actors";
  c.expert_parallel = 2;
  c.data_parallel = 2;
  runtime_context ctx(c);
  const auto all = ctx.init;
  ctx.keep_only({{1, 0}});  // pipeline 1: experts 2 and 3 of each layer
  std::set<std::string> kept;
  for (const auto& [name, t] : ctx.init) kept.insert(name);
  int experts = 0;
  for (const auto& [name, t] : all) {
    const int e = expert_of(name);
    EXPECT_EQ(kept.count(name), e < 0 || e >= 2 ? 1u : 0u) << name;
    experts += e >= 2;
  }
  EXPECT_EQ(experts, 2 * 3 * c.layers);
  EXPECT_NO_THROW(make_slice(ctx.spec, ctx.ranges.at(0), ctx.init, 2, torch::kCPU, torch::kFloat32, {},
                             ctx.experts_of(1)));
  EXPECT_THROW(make_slice(ctx.spec, ctx.ranges.at(0), ctx.init, 2, torch::kCPU, torch::kFloat32, {}, ctx.experts_of(0)),
               model_error);
}

// The capacity factor (model.moe_capacity_factor): with 0.5 each expert takes at most
// ceil(0.5 x 16 x 2 / 4) = 4 of a sequence's 32 (token, choice) pairs, so at least half of
// every layer's pairs are dropped, and the metrics count them; expert-parallel layouts,
// with tensor and sequence parallelism too (a rank holds part of each sequence), and the
// actor runtime drop the same pairs (per sequence) and follow one process within 1e-5. A factor of E/k (2) leaves room for every pair: the same bits as no factor.
// Evaluation never drops.
TEST(ExpertParallel, ACapacityFactorDropsTheSamePairsInEveryLayout) {
  auto one = moe_job();
  one.steps = 4;
  const auto plain = train(one);
  auto roomy = one;
  roomy.moe_capacity_factor = 2;
  const auto no_drop = train(roomy);
  EXPECT_EQ(no_drop.losses, plain.losses);
  EXPECT_EQ(test::max_abs_diff(no_drop.state, plain.state), 0.0);
  EXPECT_EQ(no_drop.routed, plain.routed);

  auto capped = one;
  capped.moe_capacity_factor = 0.5;
  const auto ref = train(capped);
  const std::int64_t pairs = std::int64_t(2) * one.global_batch * one.seq_len;  // per layer
  for (int i = 0; i < one.steps; ++i) {
    for (const auto& [layer, counts] : ref.routed[std::size_t(i)]) {
      EXPECT_EQ(std::accumulate(counts.begin(), counts.end(), std::int64_t(0)), pairs) << "layer " << layer;
      EXPECT_GE(counts.back(), pairs / 2) << "step " << i << " layer " << layer;
      for (std::size_t e = 0; e + 1 < counts.size(); ++e)
        EXPECT_LE(counts[e], std::int64_t(4) * one.global_batch) << "step " << i << " layer " << layer << " expert " << e;
    }
  }
  EXPECT_NE(ref.losses, plain.losses);
  EXPECT_GT(test::max_abs_diff(ref.state, plain.state), 1e-4);  // (dropped pairs: other gradients)
  for (const auto& [t, ep, d, p] : {std::tuple{1, 2, 2, 1}, std::tuple{1, 2, 4, 2}, std::tuple{2, 1, 1, 1},
                                    std::tuple{2, 4, 2, 2}}) {
    auto c = capped;
    c.tensor_parallel = t;
    c.sequence_parallel = t > 1;
    c.expert_parallel = ep;
    c.data_parallel = d;
    c.pipeline = p;
    const auto got = train(c);
    const std::string at = "t " + std::to_string(t) + " ep " + std::to_string(ep) + " d " + std::to_string(d) +
                           " p " + std::to_string(p);
    EXPECT_LE(test::max_abs_diff(got.state, ref.state), 1e-5) << at;
    for (int i = 0; i < one.steps; ++i) {
      EXPECT_NEAR(got.losses[std::size_t(i)], ref.losses[std::size_t(i)], 1e-5) << at << " step " << i;
      EXPECT_EQ(got.routed[std::size_t(i)], ref.routed[std::size_t(i)])
          << at << " step " << i << ": routing decisions differed: "
          << routing_differences(got.routed[std::size_t(i)], ref.routed[std::size_t(i)]);
    }
  }
  // The actor runtime (EP 2 over 2 replicas, 2 stages; and over a tensor-parallel pair
  // with sequence parallelism): the metrics' dropped pairs.
  test::temp_dir dir;
  for (const int t : {1, 2}) {
    auto c = capped;
    c.runtime = "actors";
    c.tensor_parallel = t;
    c.sequence_parallel = t > 1;
    c.expert_parallel = 2;
    c.data_parallel = 3 - t;
    c.pipeline = 2;
    c.metrics = dir / ("metrics" + std::to_string(t) + ".jsonl");
    actor_run_options quiet;
    quiet.quiet = true;
    const auto got = run_actor_training(c, quiet);
    ASSERT_EQ(got.exit_code, 0) << "t " << t << ": " << got.error;
    EXPECT_LE(test::max_abs_diff(got.final_state, ref.state), 1e-5) << "t " << t;
    std::ifstream metrics(c.metrics);
    int i = 0;
    for (std::string line; std::getline(metrics, line);) {
      const auto j = nlohmann::json::parse(line);
      if (!j.contains("loss")) continue;
      ASSERT_LT(i, one.steps);
      EXPECT_EQ(j.at("expert_dropped").get<std::int64_t>(), expert_pairs_dropped(ref.routed[std::size_t(i)]))
          << "t " << t << " step " << i;
      ++i;
    }
    EXPECT_EQ(i, one.steps) << "t " << t;
  }
  // Evaluation drops nothing: the same scores with and without a factor.
  EXPECT_EQ(local_trainer(capped).evaluate().loss, local_trainer(one).evaluate().loss);
}

// Megatron's folding of the expert groups onto a tensor-parallel layout: EP consecutive
// ranks (tensor-parallel rank fastest) form a group, each rank's experts compute on its
// part of the sequences (sequence parallelism), the load-balancing loss's per-sequence
// sums are reduced over the tensor-parallel group. Groups inside one replica's pair of
// ranks, across two replicas, with a pipeline, and tensor parallelism alone follow one
// process within 1e-5 after kSteps steps, with the same routing and load-balancing loss.
TEST(ExpertParallel, ExpertGroupsFoldOntoTensorParallelRanks) {
  auto one = moe_job();
  const auto ref = train(one);
  struct layout {
    int t, ep, d, p;
  };
  for (const auto& l : {layout{2, 1, 1, 1}, layout{2, 2, 1, 1}, layout{2, 4, 2, 1}, layout{2, 2, 2, 2}}) {
    auto c = one;
    c.tensor_parallel = l.t;
    c.sequence_parallel = true;
    c.expert_parallel = l.ep;
    c.data_parallel = l.d;
    c.pipeline = l.p;
    const auto got = train(c);
    const std::string at = "t " + std::to_string(l.t) + " ep " + std::to_string(l.ep) + " d " + std::to_string(l.d) +
                           " p " + std::to_string(l.p);
    EXPECT_LE(test::max_abs_diff(got.state, ref.state), 1e-5) << at;
    for (int i = 0; i < one.steps; ++i) {
      EXPECT_NEAR(got.losses[std::size_t(i)], ref.losses[std::size_t(i)], 1e-5) << at << " step " << i;
      EXPECT_NEAR(got.aux[std::size_t(i)], ref.aux[std::size_t(i)], 1e-6) << at << " step " << i;
      EXPECT_EQ(got.routed[std::size_t(i)], ref.routed[std::size_t(i)])
          << at << " step " << i << ": routing decisions differed: "
          << routing_differences(got.routed[std::size_t(i)], ref.routed[std::size_t(i)]);
    }
  }
}

// The same folding in the actor runtime (in-process groups): the expert-parallel group
// the tensor-parallel pair of a replica with a pipeline, a group over two replicas' pairs,
// and combined-1f1b's pairs (run one after the other with tensor parallelism) follow one
// process within 1e-5 after kSteps steps, with the same load-balancing loss (reported once
// per tensor-parallel group) and routing (each rank's part of the sequences); the pipeline
// evaluation (every pipeline of the replicas a group spans runs each of their forwards,
// the first replica's ranks score) equals the plain loop's.
TEST(ExpertParallel, StageActorsFoldExpertGroupsOntoTensorParallelRanks) {
  auto one = moe_job();
  one.eval_tokens = 32;  // several evaluation forwards per group
  local_trainer plain(one);
  std::vector<step_stats> ref;
  for (int i = 0; i < one.steps; ++i) ref.push_back(plain.step());
  const auto ref_eval = plain.evaluate();
  struct layout {
    int t, ep, d, p, m;
    const char* schedule;
  };
  test::temp_dir dir;
  actor_run_options quiet;
  quiet.quiet = true;
  for (const auto& l : {layout{2, 2, 1, 2, 2, "1f1b"}, layout{2, 4, 2, 1, 2, "1f1b"},
                        layout{2, 2, 1, 1, 4, "combined-1f1b"}}) {
    auto c = one;
    c.runtime = "actors";
    c.tensor_parallel = l.t;
    c.sequence_parallel = true;
    c.expert_parallel = l.ep;
    c.data_parallel = l.d;
    c.pipeline = l.p;
    c.microbatches = l.m;
    c.schedule = l.schedule;
    const std::string at = "t " + std::to_string(l.t) + " ep " + std::to_string(l.ep) + " d " + std::to_string(l.d) +
                           " p " + std::to_string(l.p) + " " + l.schedule;
    c.metrics = dir / (std::to_string(l.ep) + l.schedule + ".jsonl");
    const auto got = run_actor_training(c, quiet);
    ASSERT_EQ(got.exit_code, 0) << at << ": " << got.error;
    EXPECT_LE(test::max_abs_diff(got.final_state, plain.state()), 1e-5) << at;
    ASSERT_EQ(got.evaluations.size(), 1u) << at;
    EXPECT_NEAR(got.evaluations[0].loss, ref_eval.loss, 1e-5) << at;
    expect_metrics_follow(c.metrics, ref, at);
  }
}

TEST(ExpertParallel, BadLayoutsSaySo) {
  const auto error_of = test::config_error_of;
  auto c = moe_job();
  c.expert_parallel = 3;
  c.data_parallel = 3;
  c.global_batch = 12;
  EXPECT_NE(error_of(c).find("the 4 experts do not split over 3 ranks"), std::string::npos) << error_of(c);
  c = moe_job();
  c.expert_parallel = 2;
  EXPECT_NE(error_of(c).find("expert_parallel 2 does not divide data_parallel x tensor_parallel 1 x 1"), std::string::npos) << error_of(c);
  c.data_parallel = 2;
  c.runtime = "actors";
  c.schedule = "dataflow";
  EXPECT_NE(error_of(c).find("expert_parallel 2 with schedule dataflow"), std::string::npos) << error_of(c);
  c.schedule = "1f1b";
  EXPECT_EQ(error_of(c), "");
  auto dense = job_config::defaults_for("llama-tiny");
  dense.expert_parallel = 2;
  dense.data_parallel = 2;
  dense.runtime = "local";
  EXPECT_NE(error_of(dense).find("the model has no experts"), std::string::npos) << error_of(dense);
  c = moe_job();
  c.tensor_parallel = 2;
  EXPECT_NE(error_of(c).find("experts with tensor_parallel 2 need sequence_parallel = true"), std::string::npos)
      << error_of(c);
  c.sequence_parallel = true;
  c.expert_parallel = 2;  // (the group: the tensor-parallel pair)
  EXPECT_EQ(error_of(c), "");
  c.expert_parallel = 8;
  c.experts = 8;
  EXPECT_NE(error_of(c).find("expert_parallel 8 does not divide data_parallel x tensor_parallel 1 x 2"),
            std::string::npos) << error_of(c);
  dense.expert_parallel = 1;
  dense.moe_capacity_factor = 1.25;
  EXPECT_NE(error_of(dense).find("moe_capacity_factor 1.25: the model has no experts"), std::string::npos)
      << error_of(dense);
}

}  // namespace troupe

namespace troupe {

// A checkpoint written with EP 2 resumes with EP 4 (and another data-parallel width): the
// run continues as one process's does.
TEST(ExpertParallel, ACheckpointResumesWithAnotherExpertWidth) {
  auto one = moe_job();
  const auto ref = train(one);
  test::temp_dir dir;
  auto a = one;
  a.expert_parallel = 2;
  a.data_parallel = 2;
  {
    local_trainer t(a, std::nullopt, in_process_groups);
    for (int i = 0; i < 5; ++i) t.step();
    t.save_checkpoint(dir / "ep2.pt");
  }
  auto b = one;
  b.expert_parallel = 4;
  b.data_parallel = 4;
  b.load = dir / "ep2.pt";
  local_trainer t(b, std::nullopt, in_process_groups);
  ASSERT_EQ(t.next_step(), 5);
  for (int i = 5; i < one.steps; ++i) EXPECT_NEAR(t.step().loss, ref.losses[std::size_t(i)], 1e-5) << "step " << i;
  EXPECT_LE(test::max_abs_diff(t.state(), ref.state), 1e-5);
}

// The actor runtime with the experts sharded (EP 4 over 2 replicas' tensor-parallel
// pairs: each pipeline holds one expert per layer, each share one shard group of 1): the
// checkpoint folder that replica 0's stage actors write with the other pipelines' experts
// and every shard's moments holds what the run's --save file holds (the whole model), and
// it resumes with EP 2 (two experts per pipeline, shard groups of 2) as the run went on;
// in bf16 likewise.
TEST(ExpertParallel, CheckpointFoldersHoldEveryExpertAndResumeWithAnotherWidth) {
  test::temp_dir dir;
  auto c = moe_job();
  c.runtime = "actors";
  c.tensor_parallel = 2;
  c.sequence_parallel = true;
  c.expert_parallel = 4;
  c.data_parallel = 2;
  c.steps = 4;
  c.checkpoint_dir = dir / "ckpt";
  c.checkpoint_interval = 2;
  c.save = dir / "run.pt";
  actor_run_options quiet;
  quiet.quiet = true;
  const auto run = run_actor_training(c, quiet);
  ASSERT_EQ(run.exit_code, 0) << run.error;
  const auto ckpt = read_checkpoint_dir(dir / "ckpt/step-00000004", c);
  EXPECT_EQ(test::max_abs_diff(ckpt.model, load_state_dict(c.save)), 0.0);
  const state_dict optim(ckpt.optim.begin(), ckpt.optim.end());
  EXPECT_EQ(test::max_abs_diff(optim, load_state_dict(c.save + ".optim")), 0.0);
  auto one = moe_job();
  one.steps = c.steps;
  local_trainer plain(one);
  for (int i = 0; i < c.steps; ++i) plain.step();
  EXPECT_LE(test::max_abs_diff(ckpt.model, plain.state()), 1e-5);
  auto resumed = c;
  resumed.expert_parallel = 2;
  resumed.save.clear();
  resumed.checkpoint_dir.clear();
  resumed.resume = dir / "ckpt/step-00000002";
  const auto again = run_actor_training(resumed, quiet);
  ASSERT_EQ(again.exit_code, 0) << again.error;
  ASSERT_EQ(again.losses.size(), 2u);
  EXPECT_NEAR(again.losses[1], run.losses[3], 1e-6);
  EXPECT_LE(test::max_abs_diff(again.final_state, run.final_state), 1e-6);
  // bf16 (the stages' parameters rounded, the shards' fp32 main parameters written): the
  // folder holds the --save file's values too.
  auto bf16 = c;
  bf16.precision = "bf16";
  bf16.steps = 2;
  bf16.checkpoint_dir = dir / "bf16";
  bf16.save = dir / "bf16.pt";
  ASSERT_EQ(run_actor_training(bf16, quiet).exit_code, 0);
  const auto half = read_checkpoint_dir(dir / "bf16/step-00000002", bf16);
  EXPECT_EQ(test::max_abs_diff(half.model, load_state_dict(bf16.save)), 0.0);
  const state_dict half_optim(half.optim.begin(), half.optim.end());
  EXPECT_EQ(test::max_abs_diff(half_optim, load_state_dict(bf16.save + ".optim")), 0.0);
}

}  // namespace troupe

namespace troupe {

// The actor runtime: the stage actors of an expert-parallel group meet in every expert
// layer's all-to-all (in-process communicators). EP 2 with a pipeline (1f1b, interleaved,
// dualpipev), EP 2 with combined-1f1b and EP 4 follow one process within 1e-5 after 10
// steps, with the same routing and load-balancing loss (the metrics), each stage in its
// schedule's order, the forward of each overlapped pair (combined-1f1b, dualpipev)
// computing while its backward does (an all-to-all of one inside the other's span), and
// the same bits with parallel.overlap_pairs = false (no such all-to-all); the pipeline
// evaluation (several forwards, each run by every rank of its group in one order) equals
// the plain loop's. A stage that throws while its peers wait in an all-to-all is retried
// in place, and the run ends bit-identical to the fault-free one.
TEST(ExpertParallel, StageActorsOfAGroupMeetInTheAllToAll) {
  auto one = moe_job();
  one.layers = 4;        // 2 stages x 2 chunks
  one.eval_tokens = 32;  // two windows per forward: several evaluation forwards per group
  local_trainer plain(one);
  std::vector<step_stats> ref;
  for (int i = 0; i < one.steps; ++i) ref.push_back(plain.step());
  const auto ref_eval = plain.evaluate();
  struct layout {
    int ep, d, p, v, m;
    const char* schedule;
  };
  test::temp_dir dir;
  actor_run_options quiet;
  quiet.quiet = true;
  for (const auto& l : {layout{2, 2, 2, 1, 2, "1f1b"}, layout{4, 4, 1, 1, 2, "1f1b"},
                        layout{2, 4, 2, 2, 2, "interleaved-1f1b"}, layout{2, 2, 1, 1, 4, "combined-1f1b"},
                        layout{2, 2, 2, 2, 4, "dualpipev"}}) {
    auto c = one;
    c.runtime = "actors";
    c.expert_parallel = l.ep;
    c.data_parallel = l.d;
    c.pipeline = l.p;
    c.chunks = l.v;
    c.microbatches = l.m;
    c.schedule = l.schedule;
    const std::string at = "ep " + std::to_string(l.ep) + " d " + std::to_string(l.d) + " p " + std::to_string(l.p) +
                           " " + l.schedule;
    c.metrics = dir / (std::to_string(l.ep) + l.schedule + ".jsonl");
    const auto got = run_actor_training(c, quiet);
    ASSERT_EQ(got.exit_code, 0) << at << ": " << got.error;
    EXPECT_LE(test::max_abs_diff(got.final_state, plain.state()), 1e-5) << at;
    ASSERT_EQ(got.losses.size(), ref.size()) << at;
    for (std::size_t i = 0; i < ref.size(); ++i) EXPECT_NEAR(got.losses[i], ref[i].loss, 1e-5) << at << " step " << i;
    expect_metrics_follow(c.metrics, ref, at);
    const auto sched = make_schedule(parse_schedule_kind(l.schedule), l.p, l.m, l.v);
    for (std::int64_t step : {std::int64_t(0), std::int64_t(one.steps - 1)}) {
      const auto ops = actor_test::executed(got.events, step);
      ASSERT_EQ(ops.size(), std::size_t(l.p * l.d)) << at;
      for (const auto& [track, order] : ops)
        EXPECT_EQ(order, actor_test::as_traced(sched.ranks[std::size_t(track.second)]))
            << at << " replica " << track.first << " stage " << track.second;
    }
    // Each expert layer's all-to-alls on the trace, inside the op they served: three in a
    // forward (the counts, the tokens, their results back), two in a backward.
    int first = 0;
    for (const auto& e : got.events)
      first += e.name == "all-to-all" && e.step == 0 && e.mb >= 0 && e.mb < l.m && e.chunk >= 0 && e.chunk < l.v &&
               e.bytes >= 0 && e.end_us >= e.start_us;
    EXPECT_EQ(first, l.d * l.m * 5 * one.layers) << at;
    // An overlapped pair's forward computes beside its backward: some all-to-all of one
    // (its micro-batch and chunk, within its span) starts while the other runs.
    const auto [pairs, overlapped] = overlapped_pairs(got.events, sched, l.d, one.steps);
    EXPECT_EQ(overlapped, pairs) << at;
    if (pairs > 0) {  // parallel.overlap_pairs = false: one after the other, the same bits
      auto one_by_one = c;
      one_by_one.overlap_pairs = false;
      one_by_one.metrics.clear();
      const auto sequential = run_actor_training(one_by_one, quiet);
      ASSERT_EQ(sequential.exit_code, 0) << sequential.error;
      EXPECT_EQ(sequential.losses, got.losses) << at;
      EXPECT_EQ(test::max_abs_diff(sequential.final_state, got.final_state), 0.0) << at;
      EXPECT_EQ(overlapped_pairs(sequential.events, sched, l.d, one.steps).second, 0) << at;
    }
    ASSERT_EQ(got.evaluations.size(), 1u) << at;
    EXPECT_NEAR(got.evaluations[0].loss, ref_eval.loss, 1e-5) << at;
    // Every rank of a group ran each of its group's forwards through each of its chunks.
    int eval_forwards = 0;
    for (const auto& e : got.events) eval_forwards += e.name == "eval F";
    const int forwards = int(plan_evaluation(training_data(c, training_data::use::evaluation).evaluation_set(), true,
                                             c.eval_tokens).size());
    EXPECT_GT(forwards, l.d / l.ep) << at;
    EXPECT_EQ(eval_forwards, forwards * l.ep * l.p * l.v) << at;
    // The last step's, and its evaluation's: three per expert layer of each forward, on
    // every rank of the forward's group.
    int last = 0;
    for (const auto& e : got.events) last += e.name == "all-to-all" && e.step == one.steps - 1;
    EXPECT_EQ(last, l.d * l.m * 5 * one.layers + forwards * l.ep * 3 * one.layers) << at;

    if (l.schedule != std::string("1f1b") || l.ep != 2) continue;
    auto faulty = c;
    faulty.throw_at = "1:1:4";
    faulty.metrics.clear();
    const auto retried = run_actor_training(faulty, quiet);
    ASSERT_EQ(retried.exit_code, 0) << retried.error;
    EXPECT_EQ(retried.losses, got.losses);
    EXPECT_EQ(test::max_abs_diff(retried.final_state, got.final_state), 0.0);
  }
}

}  // namespace troupe
