// train.compute = "simulated" (actors/simulated/): the real coordinator, supervisors and
// loaders drive stage and shard actors whose ops are timers of the planner's cost model.
// Checked: every stage runs its schedule's list in order, no op ends before its modelled
// time, no step is shorter than the modelled pipeline, the losses are those a simulated
// stage reports, an injected fault is retried in place, a lost simulated node rejoins from
// its buddy's copies, and a 1,024-rank layout (Llama 3 8B's shape at TP 8 x PP 16 x DP 8)
// runs.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <filesystem>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>
#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>

#include "actors/runtime.hpp"
#include "actors/simulated/simulated.hpp"
#include "compute/schedule/schedule.hpp"
#include "test_util.hpp"

namespace troupe {

namespace {

/// A Llama-shaped model of `layers` layers; `scale` brings its H100 step to a fraction of
/// a second.
job_config simulated_job(int layers, int d_model, int seq_len, double scale) {
  auto c = job_config::defaults_for("llama-tiny");
  c.device = "cpu";
  c.compute = "simulated";
  c.simulated_device = "h100";
  c.simulated_time_scale = scale;
  c.layers = layers;
  c.d_model = d_model;
  c.heads = d_model / 128;
  c.kv_heads = std::max(1, c.heads / 4);
  c.d_ff = d_model * 7 / 2;
  c.seq_len = seq_len;
  c.vocab = 32000;
  c.steps = 2;
  c.eval_interval = 0;
  return c;
}

actor_run_result run_quiet(const job_config& c) {
  actor_run_options o;
  o.quiet = true;
  return run_actor_training(c, o);
}

/// `c` run quietly with its log (debug level) captured, `meanwhile` on a thread of its own
/// during the run; returns the log.
std::string run_logged(const job_config& c, actor_run_result& r, const std::function<void()>& meanwhile = nullptr) {
  std::ostringstream log;
  auto capture = std::make_shared<spdlog::logger>("captured", std::make_shared<spdlog::sinks::ostream_sink_mt>(log));
  capture->set_level(spdlog::level::debug);
  const auto previous = spdlog::default_logger();
  spdlog::set_default_logger(capture);
  std::thread side;
  if (meanwhile) side = std::thread(meanwhile);
  r = run_quiet(c);
  if (side.joinable()) side.join();
  spdlog::set_default_logger(previous);
  return log.str();
}

struct schedule_case {
  const char* schedule;
  int chunks;
};

class SimulatedSchedules : public ::testing::TestWithParam<schedule_case> {};

}  // namespace

TEST_P(SimulatedSchedules, EachStageRunsItsListAndNoOpEndsBeforeItsModelledTime) {
  const auto [kind, chunks] = GetParam();
  auto c = simulated_job(8, 2048, 2048, 0.2);
  c.pipeline = 2;
  c.data_parallel = 2;
  c.microbatches = 4;
  c.chunks = chunks;
  c.schedule = kind;
  c.global_batch = 16;
  const auto costs = make_simulated_costs(c, c.model());
  const auto sched = make_schedule(parse_schedule_kind(kind), c.pipeline, c.microbatches, chunks);
  const auto r = run_quiet(c);
  ASSERT_EQ(r.exit_code, 0) << r.error;
  ASSERT_EQ(r.losses.size(), 2u);
  for (double l : r.losses) EXPECT_NEAR(l, std::log(32000.0), 1e-9);  // each micro-batch's, weighted: the same
  // Per (step, replica, stage): its ops in the order they started.
  std::map<std::tuple<std::int64_t, int, int>, std::vector<trace_event>> ops;
  for (const auto& e : r.events)
    if (e.name == "F" || e.name == "B" || e.name == "W") ops[{e.step, e.replica, e.stage}].push_back(e);
  ASSERT_EQ(ops.size(), std::size_t(2 * c.data_parallel * c.pipeline));
  for (auto& [where, evs] : ops) {
    const int stage = std::get<2>(where);
    std::sort(evs.begin(), evs.end(), [](const auto& a, const auto& b) { return a.start_us < b.start_us; });
    const auto& want = sched.ranks.at(std::size_t(stage));
    ASSERT_EQ(evs.size(), want.size()) << "stage " << stage;
    for (std::size_t i = 0; i < want.size(); ++i) {
      EXPECT_EQ(evs[i].name, op_letter(want[i].kind)) << "stage " << stage << " op " << i;
      EXPECT_EQ(evs[i].mb, want[i].mb) << "stage " << stage << " op " << i;
      EXPECT_EQ(evs[i].chunk, want[i].chunk) << "stage " << stage << " op " << i;
      const auto& cc = costs->model.chunks.at(std::size_t(sched.virtual_stage(stage, want[i].chunk)));
      const double modelled = want[i].kind == op_kind::forward  ? cc.forward
                              : want[i].kind == op_kind::weight ? cc.weight
                              : want[i].split                   ? cc.backward - cc.weight
                                                                : cc.backward;
      EXPECT_GE(evs[i].end_us - evs[i].start_us, 0.999 * modelled * c.simulated_time_scale * 1e6)
          << "stage " << stage << " op " << i;
    }
  }
  // A step holds the modelled pipeline (its ops and transfers in their dependencies).
  for (double s : r.step_seconds) EXPECT_GE(s, 0.999 * costs->model.predicted.parts.pipeline * c.simulated_time_scale);
}

INSTANTIATE_TEST_SUITE_P(Kinds, SimulatedSchedules,
                         ::testing::Values(schedule_case{"1f1b", 1}, schedule_case{"interleaved-1f1b", 2},
                                           schedule_case{"zero-bubble", 1}, schedule_case{"zbv", 2},
                                           schedule_case{"gpipe", 1}),
                         [](const auto& info) {
                           std::string n = info.param.schedule;
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n;
                         });

TEST(SimulatedRun, TensorParallelRanksAndShardGroupsRunTheirSteps) {
  auto c = simulated_job(8, 2048, 2048, 0.2);
  c.pipeline = 2;
  c.data_parallel = 2;
  c.tensor_parallel = 2;
  c.sequence_parallel = true;
  c.microbatches = 4;
  c.global_batch = 16;
  const auto r = run_quiet(c);
  ASSERT_EQ(r.exit_code, 0) << r.error;
  EXPECT_EQ(r.losses.size(), 2u);
  int reduce_scatters = 0;
  for (const auto& e : r.events) reduce_scatters += e.name == "reduce-scatter";
  // Every shard (stage x pipeline) reduce-scatters its one chunk each step.
  EXPECT_EQ(reduce_scatters, 2 * c.pipeline * c.data_parallel * c.tensor_parallel);
}

// Hybrid sharding (parallel.shard_group): the planner's cost model of the layout, a
// reduce-scatter within each node's 8 ranks (NVLink) and an all-reduce of 1/8 of the
// gradients across the nodes, instead of one ring over all 16 ranks across them. The
// shards of a stage still meet as one group of 16 (the all-reduce spans the groups).
TEST(SimulatedRun, HybridShardGroupsRunWithTheirCostModel) {
  auto c = simulated_job(4, 2048, 2048, 0.5);
  c.data_parallel = 16;
  c.shard = "parameters";
  c.microbatches = 1;
  c.global_batch = 16;
  const auto spec = c.model();
  const auto whole = make_simulated_costs(c, spec);
  c.shard_group = 8;
  const auto hybrid = make_simulated_costs(c, spec);
  ASSERT_EQ(whole->model.chunks.size(), 1u);
  EXPECT_LT(hybrid->model.chunks[0].reduce_scatter, whole->model.chunks[0].reduce_scatter / 2);
  EXPECT_LT(hybrid->model.predicted.step_seconds, whole->model.predicted.step_seconds);
  const auto r = run_quiet(c);
  ASSERT_EQ(r.exit_code, 0) << r.error;
  EXPECT_EQ(r.losses.size(), 2u);
  int reduce_scatters = 0;
  for (const auto& e : r.events) reduce_scatters += e.name == "reduce-scatter";
  EXPECT_EQ(reduce_scatters, 2 * c.data_parallel);  // every shard's one chunk, each step
}

TEST(SimulatedRun, AStageThatThrowsIsRetriedInPlace) {
  auto c = simulated_job(4, 1024, 1024, 1.0);
  c.pipeline = 2;
  c.data_parallel = 2;
  c.microbatches = 4;
  c.global_batch = 16;
  c.steps = 3;
  c.throw_at = "1:1:1";  // replica 1's stage 1 in step 2 (index 1)
  const auto r = run_quiet(c);
  ASSERT_EQ(r.exit_code, 0) << r.error;
  EXPECT_EQ(r.losses.size(), 3u);
}

TEST(SimulatedRun, RefusesWhatItCannotSimulate) {
  auto expect_refused = [](job_config c, const std::string& part) {
    try {
      run_quiet(c);
      ADD_FAILURE() << "not refused: " << part;
    } catch (const config_error& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  auto c = simulated_job(4, 1024, 1024, 1.0);
  c.schedule = "dataflow";
  expect_refused(c, "fixed-order schedule");
  c = simulated_job(4, 1024, 1024, 1.0);
  c.save = "/tmp/never-written.pt";
  expect_refused(c, "no weights are read or written");
  c = job_config::defaults_for("fmnist-mlp");
  c.compute = "simulated";
  expect_refused(c, "decoder workloads only");
  c = simulated_job(4, 1024, 1024, 1.0);
  c.simulated_device = "tpu";
  expect_refused(c, "tpu");
  c = simulated_job(4, 1024, 1024, 1.0);
  c.compute = "modelled";
  EXPECT_NE(test::config_error_of(c).find("unknown compute 'modelled'"), std::string::npos);
  // Simulated nodes: an equal share each; node 0 (the coordinator's) and nodes the job
  // does not have are not killed; real compute has node processes instead.
  c = simulated_job(4, 1024, 1024, 1.0);
  c.pipeline = 2;
  c.data_parallel = 2;
  c.simulated_nodes = 3;
  expect_refused(c, "3 nodes need pipeline x data_parallel (2 x 2) divisible by the node count");
  c.simulated_nodes = 2;
  c.kill_node = "0:1";
  expect_refused(c, "node 0, the coordinator's, is not lost");
  c.kill_node = "2:1";
  expect_refused(c, "the simulated nodes that can be lost are 1 to 1");
  c.kill_node.clear();
  c.freeze_node = "0:1";
  expect_refused(c, "faults.freeze_node names node 0");
  c.freeze_node.clear();
  c.simulated_nodes = 1;
  c.kill_node = "1:1";
  expect_refused(c, "the job is one node (train.simulated_nodes 1)");
  c = simulated_job(4, 1024, 1024, 1.0);
  c.compute = "real";
  c.simulated_nodes = 2;
  EXPECT_NE(test::config_error_of(c).find("simulated_nodes 2 needs compute simulated"), std::string::npos);
}

namespace {

/// A p2 x d4 job as 4 simulated nodes, 3 steps.
job_config four_node_job() {
  auto c = simulated_job(4, 1024, 1024, 1.0);
  c.pipeline = 2;
  c.data_parallel = 4;
  c.microbatches = 4;
  c.global_batch = 16;
  c.steps = 3;
  c.simulated_nodes = 4;
  return c;
}

/// `c` run with the fault `edit` makes (its metrics in `dir`): it ends with the fault-free
/// run's losses, and its one retry is of step index 1, node 2 rejoined. Returns the run
/// and, per committed step, its seconds since the job's start.
std::pair<actor_run_result, std::map<int, double>> expect_node_2_rejoins_in_step_1(
    job_config c, const std::filesystem::path& dir, const std::function<void(job_config&)>& edit) {
  const auto plain = run_quiet(c);
  EXPECT_EQ(plain.exit_code, 0) << plain.error;
  edit(c);
  c.metrics = (dir / "metrics.jsonl").string();
  auto r = run_quiet(c);
  EXPECT_EQ(r.exit_code, 0) << r.error;
  EXPECT_EQ(r.losses, plain.losses);
  std::ifstream in(c.metrics);
  std::vector<nlohmann::json> retries;
  std::map<int, double> committed_at;
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.value("event", "") == "retry") retries.push_back(j);
    if (j.contains("step_seconds")) committed_at[j.at("step").get<int>()] = j.at("since_start_seconds").get<double>();
  }
  EXPECT_EQ(retries.size(), 1u);
  if (!retries.empty()) {
    EXPECT_EQ(retries[0].at("step").get<int>(), 1);
    EXPECT_EQ(retries[0].at("rejoined_nodes"), nlohmann::json::array({2}));
  }
  // Each committed step's ops, once: the lost attempt's are not among them.
  std::size_t stage_ops = 0, plain_ops = 0;
  for (const auto& e : r.events) stage_ops += e.name == "F" || e.name == "B";
  for (const auto& e : plain.events) plain_ops += e.name == "F" || e.name == "B";
  EXPECT_EQ(stage_ops, plain_ops);
  return {std::move(r), std::move(committed_at)};
}

}  // namespace

// Simulated nodes (train.simulated_nodes): a p2 x d4 job as 4 failure domains, node 2 lost
// as step 2 begins (faults.kill_node). The coordinator sees its supervisor gone, the
// registrar starts a fresh one, which takes its shards' state from node 3 (its buddy:
// every shard of node 2 copied its state there each step), and the step runs again:
// every step commits, and the metrics' retry line names the rejoined node.
TEST(SimulatedRun, ALostNodeRejoinsFromItsBuddysCopies) {
  test::temp_dir dir;
  expect_node_2_rejoins_in_step_1(four_node_job(), dir.path, [](job_config& c) { c.kill_node = "2:1"; });
}

// A silent node (faults.freeze_node: frozen, or cut off): node 2 starts no op as step 2
// begins, and nothing of it reaches the job. It is lost only once its connection times
// out (5 s of silence), then rejoins as a killed node does: every step commits, with the
// plain run's losses, and the step that lost it lasted at least the timeout.
TEST(SimulatedRun, ASilentNodeIsLostWhenItsConnectionTimesOutAndRejoins) {
  test::temp_dir dir;
  auto c = four_node_job();
  c.hang_min_seconds = 60;  // (the connection timeout, not the hang watchdog, finds it)
  const auto [r, committed_at] =
      expect_node_2_rejoins_in_step_1(c, dir.path, [](job_config& j) { j.freeze_node = "2:1"; });
  ASSERT_TRUE(committed_at.count(0) && committed_at.count(1));
  EXPECT_GE(committed_at.at(1) - committed_at.at(0), 5.0) << "lost before its connection timed out";
  // A real job's node is frozen with SIGSTOP: the key is refused there.
  auto real = c;
  real.freeze_node = "2:1";
  real.compute = "real";
  real.simulated_nodes = 1;
  EXPECT_NE(test::config_error_of(real).find("faults.freeze_node silences a simulated node"), std::string::npos);
}

// A silent node answers nothing, as a frozen process would not: node 2 goes silent as
// step 2 begins and a stage of node 1 throws in it, so the step is retried in place at
// once. Node 2's supervisor neither rebuilds nor answers; the round waits until node 2's
// connection times out, and then node 2 rejoins from its buddy's copies as a lost node
// does. (Answering, it would rebuild its actors and run again as if never silent: one
// retry naming no rejoined node, within the timeout.)
TEST(SimulatedRun, ASilentNodeIsNotRebuiltInPlaceByAnotherFaultsRetry) {
  test::temp_dir dir;
  auto c = four_node_job();
  c.hang_min_seconds = 60;
  const auto [r, committed_at] = expect_node_2_rejoins_in_step_1(c, dir.path, [](job_config& j) {
    j.freeze_node = "2:1";
    j.throw_at = "1:1:1";
  });
  ASSERT_TRUE(committed_at.count(0) && committed_at.count(1));
  EXPECT_GE(committed_at.at(1) - committed_at.at(0), 5.0) << "rebuilt before its connection timed out";
}

// A silent node's actors do not answer the hang probe, as a frozen process's would not: a
// status request (SIGUSR2's) while node 2 is silent finds its shards and loader silent,
// and its supervisor's board missing, where they used to answer what they wait for.
TEST(SimulatedRun, ASilentNodesActorsDoNotAnswerTheProbe) {
  auto c = four_node_job();
  c.hang_min_seconds = 60;
  c.freeze_node = "2:1";
  actor_run_result r;
  // (The probe starts within a watchdog tick of a request, long before the node's 5 s; a
  // second request in case the first came before step 2 began, on a loaded machine.)
  const auto text = run_logged(c, r, [] {
    for (int i = 0; i < 2; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1000));
      request_status();
    }
  });
  ASSERT_EQ(r.exit_code, 0) << r.error;
  ASSERT_NE(text.find("status of step 2/3"), std::string::npos) << text;
  for (const auto* actor : {"shard[stage 0, rank 2] (node 2)", "shard[stage 1, rank 2] (node 2)",
                            "loader[replica 2] (node 2)", "stage[replica 2, stage 0] (node 2)"})
    EXPECT_NE(text.find(std::string(actor) + " did not answer within 2 s: its node process did not answer either"),
              std::string::npos)
        << actor << "\n"
        << text;
  // Another node's actors answer.
  EXPECT_NE(text.find("shard[stage 0, rank 1] (node 1) waits for"), std::string::npos) << text;
}

// A step retried in place on simulated nodes: there are no parameters to gather from the
// snapshots, but the rebuild waits for that all-gather's modelled time (each node's
// slowest stage's), as a real rebuild waits for the all-gather itself.
TEST(SimulatedRun, ARebuildWaitsForTheModelledAllGatherOfTheParameters) {
  test::temp_dir dir;
  auto c = four_node_job();
  c.d_model = 4096;  // (wide and short: the parameters' all-gather is long beside the ops)
  c.heads = 32;
  c.kv_heads = 8;
  c.d_ff = 14336;
  c.seq_len = 128;
  c.simulated_time_scale = 50;
  c.throw_at = "1:1:1";
  c.metrics = (dir.path / "metrics.jsonl").string();
  const auto costs = make_simulated_costs(c, c.model());
  double gather = 0;  // (one chunk per stage; a node holds a replica's two stages)
  for (const auto& chunk : costs->model.chunks) gather = std::max(gather, chunk.all_gather);
  ASSERT_GT(gather * c.simulated_time_scale, 0.1);
  const auto r = run_quiet(c);
  ASSERT_EQ(r.exit_code, 0) << r.error;
  std::ifstream in(c.metrics);
  int retries = 0;
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.value("event", "") != "retry") continue;
    ++retries;
    EXPECT_GE(j.at("rebuild_seconds").get<double>(), gather * c.simulated_time_scale);
  }
  EXPECT_EQ(retries, 1);
}

// Simulated nodes exchange addresses at a recovery as node processes do, through the
// registrar, each getting its part of the table: p 4 x d 2 on 4 nodes (a node: two stages
// of one replica), node 2 lost. Each node gets its two shard groups' 4 entries and the
// world entries of itself and its 2 peers (world_peers), 7 of the 12; so at the job's start.
TEST(SimulatedRun, NodesExchangeTheirAddressesAtARecovery) {
  auto c = four_node_job();
  c.pipeline = 4;
  c.data_parallel = 2;
  c.global_batch = 8;
  c.kill_node = "2:1";
  actor_run_result r;
  const auto text = run_logged(c, r);
  ASSERT_EQ(r.exit_code, 0) << r.error;
  for (int node = 0; node < 4; ++node)
    EXPECT_NE(text.find("node " + std::to_string(node) + ": 7 address entries in round 1"), std::string::npos)
        << node << "\n"
        << text;
  // And at the job's start (round 0), before any node spawns its actors.
  EXPECT_NE(text.find("the join's address exchange: 12 entries, 28 to the 4 nodes"), std::string::npos) << text;
}

// A real run's trace as the cost model (simulated_device "trace:FILE"): each virtual
// stage's op times are the medians of the trace's ops after the first step, and the
// simulated run's ops last at least as long.
TEST(SimulatedRun, ReplaysARealRunsTrace) {
  auto c = test::small_config(4);
  c.pipeline = 2;
  c.data_parallel = 2;
  c.microbatches = 4;
  c.eval_interval = 0;
  const auto path = ::testing::TempDir() + "/troupe-simulated-replay-trace.json";
  c.trace = path;
  const auto real = run_quiet(c);
  ASSERT_EQ(real.exit_code, 0) << real.error;
  std::map<std::pair<int, std::string>, std::vector<double>> durations;  // (virtual stage, op) -> seconds
  const auto sched = make_schedule(parse_schedule_kind(c.schedule), c.pipeline, c.microbatches, c.chunks);
  for (const auto& e : real.events)
    if ((e.name == "F" || e.name == "B") && e.step >= 1)
      durations[{sched.virtual_stage(e.stage, e.chunk), e.name}].push_back((e.end_us - e.start_us) * 1e-6);
  auto median = [](std::vector<double> v) {
    std::nth_element(v.begin(), v.begin() + std::ptrdiff_t(v.size() / 2), v.end());
    return v[v.size() / 2];
  };
  auto sim = c;
  sim.trace.clear();
  sim.compute = "simulated";
  sim.simulated_device = "trace:" + path;
  sim.simulated_time_scale = 1;
  const auto costs = make_simulated_costs(sim, sim.model());
  ASSERT_EQ(costs->model.chunks.size(), 2u);
  for (int x = 0; x < 2; ++x) {
    // (the trace's microseconds have three decimals)
    EXPECT_NEAR(costs->model.chunks[std::size_t(x)].forward, median(durations[{x, "F"}]), 1e-6) << "virtual stage " << x;
    EXPECT_NEAR(costs->model.chunks[std::size_t(x)].backward, median(durations[{x, "B"}]), 1e-6) << "virtual stage " << x;
  }
  const auto r = run_quiet(sim);
  ASSERT_EQ(r.exit_code, 0) << r.error;
  for (const auto& e : r.events)
    if (e.name == "F" || e.name == "B") {
      const int x = sched.virtual_stage(e.stage, e.chunk);
      const auto& cc = costs->model.chunks[std::size_t(x)];
      EXPECT_GE(e.end_us - e.start_us, 0.999 * 1e6 * (e.name == "F" ? cc.forward : cc.backward));
    }
  // A trace of another layout is refused with its reason.
  auto other = sim;
  other.pipeline = 4;
  other.layers = 4;
  EXPECT_THROW(make_simulated_costs(other, other.model()), config_error);
  std::remove(path.c_str());
}

// 1,024 ranks in one process: Llama 3 8B's shape (32 layers, d_model 4096, 32 heads, 8 kv
// heads, d_ff 14336, sequence 4096) at TP 8 x PP 16 x DP 8, its H100 step scaled down a
// thousandfold. The control plane at that size (tests/bench/simulated has 4k and 16k),
// as one node and as 128 nodes of 8 ranks: the coordinator's messages of a step are five
// per node, whatever the ranks (begin_step and the clip factor to each node's supervisor;
// from each, its shards' gradient-norm partials, its stages' reports with their losses,
// and its shards' reports, in one message each).
TEST(SimulatedRun, AThousandRanksRunTheirSteps) {
  test::temp_dir dir;
  auto c = job_config::defaults_for("llama-tiny");
  c.device = "cpu";
  c.compute = "simulated";
  c.simulated_time_scale = 0.001;
  c.layers = 32;
  c.d_model = 4096;
  c.heads = 32;
  c.kv_heads = 8;
  c.d_ff = 14336;
  c.seq_len = 4096;
  c.vocab = 128256;
  c.tensor_parallel = 8;
  c.sequence_parallel = true;
  c.pipeline = 16;
  c.data_parallel = 8;
  c.microbatches = 16;
  c.global_batch = 128;
  c.steps = 3;
  c.eval_interval = 0;
  for (const int nodes : {1, 128}) {
    SCOPED_TRACE(std::to_string(nodes) + " node(s)");
    c.simulated_nodes = nodes;
    c.metrics = dir / ("metrics-" + std::to_string(nodes) + ".jsonl");
    const auto r = run_quiet(c);
    ASSERT_EQ(r.exit_code, 0) << r.error;
    ASSERT_EQ(r.losses.size(), 3u);
    std::size_t stage_ops = 0;
    for (const auto& e : r.events) stage_ops += e.name == "F" || e.name == "B";
    EXPECT_EQ(stage_ops, std::size_t(3) * 1024 * 16 * 2);  // steps x ranks x micro-batches x (F, B)
    std::ifstream in(c.metrics);
    int steps = 0;
    for (std::string line; std::getline(in, line);) {
      const auto j = nlohmann::json::parse(line);
      if (!j.contains("coordinator_messages")) continue;
      ++steps;
      EXPECT_EQ(j.at("coordinator_messages").get<std::int64_t>(), 5 * nodes) << line.substr(0, 200);
    }
    EXPECT_EQ(steps, 3);
  }
}

}  // namespace troupe
