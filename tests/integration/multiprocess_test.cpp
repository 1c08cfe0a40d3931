// Multi-process jobs: node processes (troupe-node) on this machine give exactly the
// parameters and optimizer state of the in-process actor run (also with expert
// parallelism across nodes); joins without the job's
// token or with another protocol version are refused; a node that dies is noticed.
// Every test starts its processes through process_group: none is left behind.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <csignal>
#include <filesystem>
#include <map>
#include <regex>
#include <fstream>
#include <tuple>

#include "actors/node.hpp"
#include "actors/runtime.hpp"
#include "compute/checkpoint.hpp"
#include "messages/node_messages.hpp"
#include "process_group.hpp"
#include "test_util.hpp"

using namespace troupe;

namespace {

const std::string node_binary = std::filesystem::path(TROUPE_BINARY).parent_path() / "troupe-node";

int free_port() {
  static int next = 24000 + (getpid() % 4000) * 2;  // distinct per test process
  return next++;
}

struct job {
  job(int n, std::vector<std::string> a) : nodes(n), args(std::move(a)) {}
  int nodes;
  std::vector<std::string> args;  // node 0's flags
  std::string token = "test-token";
  std::vector<std::string> tokens;     // per node (empty: all `token`)
  std::vector<std::string> extra_env;  // nodes other than 0
  std::vector<std::string> cwds;       // per node (empty: this process's)
};

test::process_group start(const job& j, const test::temp_dir& dir, int port) {
  return test::process_group(
      j.nodes,
      [&](int i) {
        std::vector<std::string> argv{node_binary};
        if (i == 0) argv.insert(argv.end(), j.args.begin(), j.args.end());
        return argv;
      },
      [&](int i) {
        std::vector<std::string> env{"TROUPE_JOB_TOKEN=" + (j.tokens.empty() ? j.token : j.tokens.at(i)),
                                     "TROUPE_NODE=" + std::to_string(i), "TROUPE_NODES=" + std::to_string(j.nodes),
                                     "TROUPE_COORDINATOR=127.0.0.1:" + std::to_string(port)};
        if (i > 0) env.insert(env.end(), j.extra_env.begin(), j.extra_env.end());
        return env;
      },
      dir.path.string(), 0, j.cwds);
}

struct layout {
  int p, d, nodes;
  std::string precision = "fp32";
  int bucket_size = 0;  // gradient buckets (reduce-scattered during the last backward)
};
[[maybe_unused]] void PrintTo(const layout& l, std::ostream* os) {
  *os << "p" << l.p << " d" << l.d << " on " << l.nodes << " nodes, " << l.precision << ", buckets of "
      << l.bucket_size;
}

std::string name_of(const ::testing::TestParamInfo<layout>& info) {
  return "p" + std::to_string(info.param.p) + "_d" + std::to_string(info.param.d) + "_" +
         std::to_string(info.param.nodes) + "nodes" + (info.param.precision == "fp32" ? "" : "_" + info.param.precision) +
         (info.param.bucket_size ? "_buckets" : "");
}

/// Runs `cfg` in this process (saving DIR/single.pt) and expects what the node processes
/// wrote to be exactly its: DIR/multi.pt and its moments, and the final evaluation's loss
/// on the last line of DIR/multi.jsonl.
void expect_the_in_process_run(job_config cfg, const test::temp_dir& dir, const std::string& at) {
  cfg.save = dir / "single.pt";
  actor_run_options quiet;
  quiet.quiet = true;
  const auto single = run_actor_training(cfg, quiet);
  ASSERT_EQ(single.exit_code, 0) << at << ": " << single.error;
  EXPECT_EQ(test::max_abs_diff(load_state_dict(dir / "multi.pt"), load_state_dict(dir / "single.pt")), 0.0) << at;
  EXPECT_EQ(test::max_abs_diff(load_state_dict(dir / "multi.pt.optim"), load_state_dict(dir / "single.pt.optim")), 0.0)
      << at;
  ASSERT_EQ(single.evaluations.size(), 1u) << at;
  std::ifstream metrics(dir / "multi.jsonl");
  std::string line, last;
  while (std::getline(metrics, line)) last = line;
  const auto j = nlohmann::json::parse(last);
  ASSERT_TRUE(j.contains("val_loss")) << last;
  EXPECT_EQ(j.at("val_loss").get<double>(), single.evaluations[0].loss) << at;
}

/// An address table of groups of two ranks, one per entry of `entries` (in order), rank 0
/// with GPU key `gpu0`, rank 1 with `gpu1`; no NCCL ids yet.
node_addresses two_rank_table(const std::vector<std::int32_t>& entries, const std::string& gpu0,
                              const std::string& gpu1) {
  node_addresses t;
  for (const auto entry : entries)
    for (int rank = 0; rank < 2; ++rank) {
      t.stages.push_back(entry);
      t.replicas.push_back(rank);
      t.addresses.emplace_back("a");
      t.machines.emplace_back("m");
      t.gpus.push_back(rank == 0 ? gpu0 : gpu1);
      t.nccl_ids.emplace_back();
    }
  return t;
}

}  // namespace

class MultiProcess : public ::testing::TestWithParam<layout> {};

// 10 steps over node processes == the same job in one process, bit for bit: parameters
// and AdamW moments (the checkpoint gathers both from every node). Layouts with a
// replica's stages on several nodes send activations and gradients over UCX; the others
// only the shards' collectives (in bf16 jobs they all-gather bf16 parameters; the
// checkpoint holds the fp32 main parameters; with gradient buckets, one reduce-scatter and
// all-gather per bucket).
TEST_P(MultiProcess, NodesGiveExactlyTheInProcessParameters) {
  const auto [p, d, nodes, precision, bucket_size] = GetParam();
  test::temp_dir dir;
  const std::vector<std::string> flags{"--pipeline", std::to_string(p), "--data-parallel", std::to_string(d),
                                       "--microbatches", "4", "--steps", "10", "--eval-interval", "0",
                                       "--threads", "1", "--precision", precision,
                                       "--bucket-size", std::to_string(bucket_size)};
  auto args = flags;
  args.insert(args.end(), {"--save", dir / "multi.pt", "--metrics", dir / "multi.jsonl", "--eval-tokens", "1024",
                           "--checkpoint-dir", dir / "ck"});
  auto group = start({nodes, args}, dir, free_port());
  const auto results = group.wait(std::chrono::seconds(300));
  for (int i = 0; i < nodes; ++i) ASSERT_EQ(results[i].status, 0) << "node " << i << ":\n" << results[i].output;
  EXPECT_NE(results[0].output.find("step 10/10"), std::string::npos) << results[0].output;

  auto cfg = test::gpt_config(10);
  cfg.pipeline = p;
  cfg.data_parallel = d;
  cfg.microbatches = 4;
  cfg.eval_interval = 0;
  cfg.threads = 1;
  cfg.precision = precision;
  cfg.bucket_size = bucket_size;
  cfg.eval_tokens = 1024;
  // The parameters, moments and final evaluation (in the pipeline: 4 forwards shared by
  // the replicas, activations between nodes where a replica's stages are on several).
  expect_the_in_process_run(cfg, dir, "");
  // The checkpoint folder, each stage's files written by its own node process (no process
  // gathers the model for it), holds what --save gathered: the model (in bf16 jobs the
  // fp32 main parameters) and the optimizer state, by name.
  const auto folder = dir / "ck/step-00000010";
  state_dict params, optim;
  for (int k = 0; k < p; ++k) {
    for (auto& kv : load_state_dict(folder + "/stage-" + std::to_string(k) + ".pt")) params.push_back(kv);
    for (auto& kv : load_state_dict(folder + "/optim-stage-" + std::to_string(k) + ".pt"))
      if (kv.first != "step" || k == 0) optim.push_back(kv);
  }
  EXPECT_EQ(test::max_abs_diff(params, load_state_dict(dir / "multi.pt")), 0.0);  // by name
  EXPECT_EQ(test::max_abs_diff(optim, load_state_dict(dir / "multi.pt.optim")), 0.0);
}

INSTANTIATE_TEST_SUITE_P(Layouts, MultiProcess,
                         // One layout per dimension: a pipeline across 4 nodes, replicas across 2,
                         // two replicas per node, data parallelism over 4 with gradient buckets, bf16.
                         ::testing::Values(layout{4, 1, 4}, layout{2, 2, 2}, layout{2, 4, 2},
                                           layout{1, 4, 4, "fp32", 20000}, layout{2, 2, 2, "bf16", 20000}),
                         name_of);

// llama-tiny over node processes against plain PyTorch (tests/support/python/
// gpt_reference.py --workload llama-tiny): from the same torch.save(model.state_dict())
// init, a 5-step run of p2 x d2 on 2 nodes gives the losses and the parameters of
// PyTorch's loop within 1e-5.
TEST(MultiProcessLlama, NodesFollowPlainPytorch) {
  test::temp_dir dir;
  constexpr int steps = 5;
  const std::string cmd = std::string("/usr/bin/python3 ") + TROUPE_SOURCE_DIR +
                          "/tests/support/python/gpt_reference.py " + dir.path.string() + " " +
                          std::to_string(steps) + " " + std::to_string(steps) + " --workload llama-tiny";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::vector<double> expected;
  std::ifstream in(dir / "losses.txt");
  for (double x; in >> x;) expected.push_back(x);
  ASSERT_EQ(expected.size(), std::size_t(steps));
  const std::vector<std::string> args{"--workload", "llama-tiny", "--pipeline", "2", "--data-parallel", "2",
                                      "--microbatches", "2", "--steps", std::to_string(steps),
                                      "--eval-interval", "0", "--threads", "1", "--init", dir / "init.pt",
                                      "--save", dir / "nodes.pt", "--metrics", dir / "nodes.jsonl"};
  auto group = start({2, args}, dir, free_port());
  const auto results = group.wait(std::chrono::seconds(300));
  for (int i = 0; i < 2; ++i) ASSERT_EQ(results[i].status, 0) << "node " << i << ":\n" << results[i].output;
  std::ifstream metrics(dir / "nodes.jsonl");
  std::vector<double> losses;
  for (std::string line; std::getline(metrics, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("loss")) losses.push_back(j.at("loss").get<double>());
  }
  ASSERT_EQ(losses.size(), std::size_t(steps));
  for (int i = 0; i < steps; ++i) EXPECT_NEAR(losses[i], expected[i], 1e-5) << "step " << i;
  EXPECT_LE(test::max_abs_diff(load_state_dict(dir / "nodes.pt"), load_state_dict(dir / "final.pt")), 1e-5);
}

// Expert parallelism over node processes: the stage actors of an expert-parallel group on
// different nodes meet in their all-to-alls over UCX (EP 2 across 2 nodes with a pipeline:
// node n hosts replica n; EP 4 across 4). The parameters, the moments and the pipeline
// evaluation (several forwards per group) are exactly the in-process run's.
TEST(MultiProcessExperts, NodesGiveExactlyTheInProcessParameters) {
  struct layout {
    int p, d, ep, nodes, t;
  };
  // (With tensor parallelism: each node one replica's tensor-parallel pair, the
  // expert-parallel group of 4 over both nodes' pairs; then each pair spread over two
  // nodes, the expert-parallel group that pair.)
  for (const auto& l : {layout{2, 2, 2, 2, 1}, layout{1, 4, 4, 4, 1}, layout{1, 2, 4, 2, 2}, layout{1, 2, 2, 4, 2}}) {
    const std::string at = "p" + std::to_string(l.p) + " d" + std::to_string(l.d) + " ep" + std::to_string(l.ep) +
                           " t" + std::to_string(l.t);
    test::temp_dir dir;
    const std::vector<std::string> args{
        "--workload", "moe-tiny", "--layers", "2", "--pipeline", std::to_string(l.p), "--data-parallel",
        std::to_string(l.d), "--expert-parallel", std::to_string(l.ep), "--microbatches", "2", "--steps", "6",
        "--eval-interval", "0", "--threads", "1", "--eval-tokens", "256", "--save", dir / "multi.pt",
        "--metrics", dir / "multi.jsonl", "--tensor-parallel", std::to_string(l.t), "--sequence-parallel",
        l.t > 1 ? "true" : "false"};
    auto group = start({l.nodes, args}, dir, free_port());
    const auto results = group.wait(std::chrono::seconds(300));
    for (int i = 0; i < l.nodes; ++i) ASSERT_EQ(results[i].status, 0) << at << " node " << i << ":\n" << results[i].output;
    auto cfg = job_config::defaults_for("moe-tiny");
    cfg.device = "cpu";
    cfg.layers = 2;
    cfg.pipeline = l.p;
    cfg.data_parallel = l.d;
    cfg.expert_parallel = l.ep;
    cfg.tensor_parallel = l.t;
    cfg.sequence_parallel = l.t > 1;
    cfg.microbatches = 2;
    cfg.steps = 6;
    cfg.eval_interval = 0;
    cfg.threads = 1;
    cfg.eval_tokens = 256;
    expect_the_in_process_run(cfg, dir, at);
    EXPECT_NE(results[0].output.find("expert-parallel " + std::to_string(l.ep) + " (" + std::to_string(4 / l.ep) + " of the 4 experts on each rank) x pipeline"), std::string::npos)
        << results[0].output;
  }
}

// A shard group runs its collectives over NCCL only when every member asked for it (named
// its GPU) and no two members share a GPU; the reason otherwise names the ranks.
TEST(MultiProcessNccl, GroupsNeedEveryMemberOnAGpuOfItsOwn) {
  EXPECT_EQ(nccl_refusal({"m1/gpu 0000:18:00.0", "m2/gpu 0000:18:00.0"}), "");  // two machines
  EXPECT_EQ(nccl_refusal({"m1/gpu 0000:18:00.0", "m1/gpu 0000:2a:00.0", "m1/gpu 0000:3a:00.0"}), "");
  const auto shared = nccl_refusal({"m1/gpu 0000:18:00.0", "m1/gpu 0000:2a:00.0", "m1/gpu 0000:18:00.0"});
  EXPECT_NE(shared.find("ranks 0 and 2 share a GPU (m1/gpu 0000:18:00.0)"), std::string::npos) << shared;
  const auto absent = nccl_refusal({"m1/gpu 0000:18:00.0", "", "m2/gpu 0000:18:00.0", ""});
  EXPECT_NE(absent.find("rank(s) 1, 3 did not ask for NCCL"), std::string::npos) << absent;
  EXPECT_NE(nccl_refusal({"m1/gpu 0000:18:00.0"}), "");
  EXPECT_NE(nccl_refusal({}), "");
}

TEST(MultiProcessNccl, LinksJoinTheNodesOfStagesThatPassTensors) {
  using pairs = std::vector<std::pair<int, int>>;
  // A pipeline of 4 over 4 nodes: neighbours both ways, and the first with the last.
  EXPECT_EQ(link_pairs(4, 1, 4), (pairs{{0, 1}, {0, 3}, {1, 0}, {1, 2}, {2, 1}, {2, 3}, {3, 0}, {3, 2}}));
  // Whole replicas per node: no tensors between nodes.
  EXPECT_EQ(link_pairs(2, 2, 2), pairs{});
  // p=4, d=2 on 4 nodes: each replica over two nodes (its first and last stage too).
  EXPECT_EQ(link_pairs(4, 2, 4), (pairs{{0, 1}, {1, 0}, {2, 3}, {3, 2}}));
  // p=3, d=2 on 3 nodes: node 1 hosts replica 0's last stage and replica 1's first.
  EXPECT_EQ(link_pairs(3, 2, 3), (pairs{{0, 1}, {1, 0}, {1, 2}, {2, 1}}));
}

// The registrar's table of p=2, d=2 on 4 nodes (stage 0's ranks on nodes 0 and 2, stage
// 1's on nodes 1 and 3), each node's entries with its GPU key (empty: it did not ask).
node_addresses table_of(const std::vector<std::string>& gpus) {
  node_addresses t;
  auto add = [&](int stage, int rank, int node) {
    t.stages.push_back(stage);
    t.replicas.push_back(rank);
    t.addresses.push_back(stage <= -2 ? "" : "ucx address");
    t.machines.push_back("m");
    t.gpus.push_back(stage <= -2 ? "" : gpus[node]);
    t.nccl_ids.emplace_back();
  };
  for (int node = 0; node < 4; ++node) {
    add(node % 2, node / 2, node);  // its slot
    add(-1, node, node);            // the world
    for (const auto& [from, to] : link_pairs(2, 2, 4))
      if (from == node && !gpus[node].empty()) add(-2 - from, to, node);
  }
  return t;
}

// Ids exactly where they are used: the rank 0 entry of each shard group and each link
// that nccl_refusal accepts. An id made for nothing would leave NCCL's bootstrap thread
// waiting for ranks that never come.
TEST(MultiProcessNccl, TheRegistrarMakesIdsOnlyWhereNcclRuns) {
  int made = 0;
  auto make_id = [&] { return "id " + std::to_string(made++); };
  auto ids_of = [](const node_addresses& t) {
    std::map<std::pair<int, int>, std::string> out;  // (stage, replica) -> id, where given
    for (std::size_t i = 0; i < t.stages.size(); ++i)
      if (!t.nccl_ids.at(i).empty()) out[{t.stages[i], t.replicas[i]}] = t.nccl_ids[i];
    return out;
  };
  using ids = std::map<std::pair<int, int>, std::string>;
  // A GPU each: both groups (in rank 0's entry) and the four links (entries -2 - from).
  auto t = table_of({"m/gpu 0", "m/gpu 1", "m/gpu 2", "m/gpu 3"});
  EXPECT_EQ(assign_nccl_ids(t, make_id), 6);
  EXPECT_EQ(made, 6);
  EXPECT_EQ(ids_of(t), (ids{{{0, 0}, "id 0"}, {{-2, 1}, "id 1"}, {{1, 0}, "id 2"},
                            {{-3, 0}, "id 3"}, {{-4, 3}, "id 4"}, {{-5, 2}, "id 5"}}));
  // One GPU for all: every group and link is refused, and no id is made.
  made = 0;
  t = table_of({"m/gpu 0", "m/gpu 0", "m/gpu 0", "m/gpu 0"});
  EXPECT_EQ(assign_nccl_ids(t, make_id), 0);
  EXPECT_EQ(made, 0);
  EXPECT_EQ(ids_of(t), ids{});
  // Node 3 did not ask: stage 1's group (nodes 1 and 3) and the link 2 -> 3 stay off.
  t = table_of({"m/gpu 0", "m/gpu 1", "m/gpu 2", ""});
  EXPECT_EQ(assign_nccl_ids(t, make_id), 3);
  EXPECT_EQ(ids_of(t), (ids{{{0, 0}, "id 0"}, {{-2, 1}, "id 1"}, {{-3, 0}, "id 2"}}));
  // Making an id failed: nothing given, and the nodes find no id (they stay on UCX).
  made = 0;
  t = table_of({"m/gpu 0", "m/gpu 1", "m/gpu 2", "m/gpu 3"});
  EXPECT_EQ(assign_nccl_ids(t, [&] { ++made; return std::string(); }), 0);
  EXPECT_EQ(made, 6);
  EXPECT_EQ(ids_of(t), ids{});
}

// A tensor-parallel group spread over two nodes (entry tensor_group_entry, rank tp): an id
// in its rank 0's entry where each member has a GPU of its own, none where they share one.
TEST(MultiProcessNccl, TheRegistrarMakesIdsForTensorParallelGroupsSpreadOverNodes) {
  auto table_of = [](const std::string& gpu0, const std::string& gpu1) {
    return two_rank_table({tensor_group_entry(0, 0, 1)}, gpu0, gpu1);
  };
  int made = 0;
  auto make_id = [&] { return "id " + std::to_string(made++); };
  auto t = table_of("m/gpu 0", "m/gpu 1");
  EXPECT_EQ(assign_nccl_ids(t, make_id), 1);
  EXPECT_EQ(t.nccl_ids, (std::vector<std::string>{"id 0", ""}));
  t = table_of("m/gpu 0", "m/gpu 0");
  EXPECT_EQ(assign_nccl_ids(t, make_id), 0);
  EXPECT_EQ(made, 1);
}

// An expert shard group (entry expert_shard_entry, rank q / EP): an id in its rank 0's
// entry where each member has a GPU of its own, none where they share one; an expert
// group's entries (the all-to-alls, UCX only) get none.
TEST(MultiProcessNccl, TheRegistrarMakesIdsForExpertShardGroups) {
  auto table_of = [](const std::string& gpu0, const std::string& gpu1) {
    return two_rank_table({expert_shard_entry(1, 1, 2), expert_group_entry(1, 0, 2, false)}, gpu0, gpu1);
  };
  EXPECT_TRUE(is_expert_shard_entry(expert_shard_entry(3, 7, 8)));
  EXPECT_FALSE(is_expert_shard_entry(expert_group_entry(3, 7, 8, true)));
  EXPECT_FALSE(is_expert_shard_entry(tensor_group_entry(0, 0, 1)));
  int made = 0;
  auto make_id = [&] { return "id " + std::to_string(made++); };
  auto t = table_of("m/gpu 0", "m/gpu 1");
  EXPECT_EQ(assign_nccl_ids(t, make_id), 1);
  EXPECT_EQ(t.nccl_ids, (std::vector<std::string>{"id 0", "", "", ""}));
  t = table_of("m/gpu 0", "m/gpu 0");
  EXPECT_EQ(assign_nccl_ids(t, make_id), 0);
  EXPECT_EQ(made, 1);
}

// A p2 x d1 job on 2 nodes whose node 1 (stage 1) pretends another machine (`env`: its
// clock's skew and drift, TROUPE_TEST_CLOCK_*). Returns node 1's log and each tensor
// message received earlier on node 0's timeline than its send began (by more than the
// offset's measuring error): the receive is an instant on the receiver's track, the send
// a slice on the sender's (the F or B before it also holds the send, so the receiver may
// start before that op's end). Checks the run ended well and every step's bubble < 0.9.
struct clock_run {
  std::string node1_log;
  std::vector<std::string> early;  ///< "step S: stage K got <what> N us before stage J sent it"
};
clock_run run_with_another_clock(const std::vector<std::string>& env, int steps) {
  test::temp_dir dir;
  const std::string trace = dir / "trace.json", metrics = dir / "m.jsonl";
  job j{2, {"--pipeline", "2", "--data-parallel", "1", "--microbatches", "4", "--steps", std::to_string(steps),
            "--eval-interval", "0", "--threads", "1", "--trace", trace, "--metrics", metrics}};
  j.extra_env = env;
  auto group = start(j, dir, free_port());
  const auto results = group.wait(std::chrono::seconds(120));
  clock_run out;
  out.node1_log = results[1].output;
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(results[i].status, 0) << "node " << i << ":\n" << results[i].output;
    if (results[i].status != 0) return out;
  }
  EXPECT_EQ(results[0].output.find("another machine"), std::string::npos) << results[0].output;

  std::map<std::tuple<std::int64_t, int, std::string, int>, double> at;  // (step, stage, name, mb) -> ts
  const auto chrome = nlohmann::json::parse(std::ifstream(trace));
  for (const auto& e : chrome.at("traceEvents")) {
    if (e.value("cat", "") != "comm") continue;
    const auto& a = e.at("args");
    at[{a.at("step").get<std::int64_t>(), a.at("stage").get<int>(), e.at("name").get<std::string>(),
        a.at("mb").get<int>()}] = e.at("ts").get<double>();
  }
  // steps x (4 micro-batches x (activation, gradient) + each stage's tied gradient) x (send, receive)
  EXPECT_EQ(at.size(), std::size_t(20 * steps));
  const double slack_us = 2000;  // the measured offset is within half a round trip
  auto check = [&](std::int64_t step, int from, int to, const std::string& what, int mb) {
    const auto sent = at.find({step, from, "send " + what, mb}), got = at.find({step, to, "recv " + what, mb});
    if (sent == at.end() || got == at.end()) {
      ADD_FAILURE() << "step " << step << ": no send or receive of " << what << " " << mb;
      return;
    }
    if (got->second < sent->second - slack_us)
      out.early.push_back("step " + std::to_string(step) + ": stage " + std::to_string(to) + " got " + what + " " +
                          std::to_string(mb) + " " + std::to_string(sent->second - got->second) +
                          " us before stage " + std::to_string(from) + " sent it");
  };
  for (std::int64_t step = 0; step < steps; ++step) {
    check(step, 0, 1, "tied gradient", -1);
    check(step, 1, 0, "tied gradient", -1);
    for (int mb = 0; mb < 4; ++mb) {
      check(step, 0, 1, "activation", mb);
      check(step, 1, 0, "gradient", mb);
    }
  }
  std::ifstream lines(metrics);
  int measured = 0;
  for (std::string line; std::getline(lines, line);) {
    const auto m = nlohmann::json::parse(line);
    if (!m.contains("bubble")) continue;
    EXPECT_LT(m.at("bubble").get<double>(), 0.9) << line;
    ++measured;
  }
  EXPECT_EQ(measured, steps);
  return out;
}

std::string lines_of(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& l : v) s += l + "\n";
  return s;
}

// A node of "another machine" whose steady clock is 5 s ahead of node 0's measures the
// offset when it joins: its stage's ops land on node 0's timeline. Stage 1 runs on the
// skewed node, so without the offset each of its ops would show 5 s late, the gradients
// it sends received 5 s before they were sent, and the measured bubble near 1.
TEST(MultiProcessClocks, ANodeWithAnotherClockJoinsNodeZerosTimeline) {
  const auto run = run_with_another_clock({"TROUPE_TEST_CLOCK_SKEW_MS=5000"}, 3);
  std::smatch found;
  const std::regex offset_line("another machine than node 0's: its clock is ([-+0-9.]+) ms");
  ASSERT_TRUE(std::regex_search(run.node1_log, found, offset_line)) << run.node1_log;
  EXPECT_NEAR(std::stod(found[1]), -5000.0, 2.0) << found[0];
  EXPECT_TRUE(run.early.empty()) << lines_of(run.early);
}

// And whose clock also runs 0.5 % fast (5 ms per second, some hundred times a real
// crystal's drift): the probes after the join follow the drift. Node 1 reports the rate
// it fitted. With the probes off (TROUPE_CLOCK_PROBE_SECONDS=0: the offset of the join
// only) the same run shows node 1's sends later and later, and node 0 receiving
// gradients before they were sent: the check can fail.
TEST(MultiProcessClocks, ANodeWhoseClockDriftsStaysOnNodeZerosTimeline) {
  const auto run = run_with_another_clock(
      {"TROUPE_TEST_CLOCK_SKEW_MS=5000", "TROUPE_TEST_CLOCK_DRIFT_PPM=5000", "TROUPE_CLOCK_PROBE_SECONDS=0.4"}, 4);
  EXPECT_TRUE(run.early.empty()) << lines_of(run.early);
  std::smatch found;
  const std::regex rate_line("its clock ran ([-+0-9.]+) ppm against node 0's \\(([0-9]+) probes");
  ASSERT_TRUE(std::regex_search(run.node1_log, found, rate_line)) << run.node1_log;
  EXPECT_NEAR(std::stod(found[1]), 5000.0, 500.0) << found[0];
  EXPECT_GE(std::stoi(found[2]), 3) << found[0];

  const auto unprobed = run_with_another_clock(
      {"TROUPE_TEST_CLOCK_SKEW_MS=5000", "TROUPE_TEST_CLOCK_DRIFT_PPM=5000", "TROUPE_CLOCK_PROBE_SECONDS=0"}, 4);
  EXPECT_FALSE(unprobed.early.empty()) << "without probes after the join, the drift went unseen";
  EXPECT_EQ(unprobed.node1_log.find("ppm against node 0's"), std::string::npos) << unprobed.node1_log;
}

// A node that joined and then fails before it is ready (here a bad TROUPE_NCCL value in
// node 1's environment only, refused with exit 2 after the join) tells node 0, which
// ends the job with node 1's reason (status 1) instead of waiting out its join timeout
// (60 s, longer than this test waits: a node 0 that waited fails the reason check).
TEST(MultiProcessJoin, ANodeThatFailsBeforeItIsReadyEndsTheJob) {
  test::temp_dir dir;
  job j{2, {"--pipeline", "2", "--steps", "2"}};
  j.extra_env = {"TROUPE_NCCL=maybe"};
  auto group = start(j, dir, free_port());
  const auto results = group.wait(std::chrono::seconds(45));
  EXPECT_EQ(results[1].status, 2) << results[1].output;
  EXPECT_NE(results[1].output.find("TROUPE_NCCL=maybe: expected 1 or 0"), std::string::npos) << results[1].output;
  EXPECT_EQ(results[0].status, 1) << results[0].output;
  EXPECT_TRUE(std::regex_search(results[0].output,
                                std::regex("node 1 on [^ ]+ cannot run this job: TROUPE_NCCL=maybe: expected 1 or 0")))
      << results[0].output;
  EXPECT_EQ(results[0].output.find("1/2 |"), std::string::npos) << "the job started without node 1";
}

// A node with another token, or another protocol version, is refused (and the refusal is
// logged by the coordinator); the job does not start with it.
TEST(MultiProcessJoin, WrongTokenOrVersionIsRefused) {
  for (const bool version : {false, true}) {
    test::temp_dir dir;
    job j{2, {"--data-parallel", "2", "--steps", "2"}};
    if (version)
      j.extra_env = {"TROUPE_PROTOCOL_VERSION=99"};
    else
      j.tokens = {"right-token", "wrong-token"};
    auto group = start(j, dir, free_port());
    ASSERT_TRUE(group.wait_for_log(0, [](const std::string& s) { return s.find("refused") != std::string::npos; },
                                   std::chrono::seconds(60)))
        << group.log(0);
    // Node 0 keeps waiting for a rightful node 1 (until its join timeout): killed here.
    const auto results = group.wait(std::chrono::seconds(5));
    EXPECT_EQ(results[1].status, 3) << results[1].output;
    EXPECT_NE(results[1].output.find(version ? "protocol version 99" : "wrong job token"), std::string::npos)
        << results[1].output;
    EXPECT_NE(results[0].output.find(version ? "protocol version 99" : "wrong job token"), std::string::npos)
        << results[0].output;
    EXPECT_EQ(results[0].output.find("1/2 |"), std::string::npos) << "the job started without node 1";
  }
}

// Each stage's node process writes its files of a checkpoint folder itself, into
// checkpoint_dir as it sees it. Nodes that do not share that folder (here a relative
// checkpoint_dir and node processes in two working folders, as on hosts without a shared
// file system) leave node 0 without stage 1's files: the checkpoint is not written, with
// the reason, and none is half-written; the run's last one ends the run (status 1).
TEST(MultiProcessCheckpoint, NodesThatDoNotShareTheFolderWriteNoCheckpoint) {
  test::temp_dir dir;
  namespace fs = std::filesystem;
  fs::create_directories(dir / "a");
  fs::create_directories(dir / "b");
  job j{2, {"--pipeline", "2", "--steps", "2", "--eval-interval", "0", "--threads", "1", "--checkpoint-dir", "ck",
            "--checkpoint-interval", "1"}};
  j.cwds = {dir / "a", dir / "b"};
  auto group = start(j, dir, free_port());
  const auto results = group.wait(std::chrono::seconds(120));
  const auto& out = results[0].output;
  EXPECT_EQ(results[0].status, 1) << out;
  // Said by node 1's process, which found no temporary folder where node 0 made one.
  EXPECT_NE(out.find("step 1: checkpoint not written: stage 1: ck/.step-00000001.tmp, which node 0 made, is not there "
                     "(with nodes on several hosts, checkpoint_dir must be one folder they all share); training goes on"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("cannot write the checkpoint of step 2 (the run's last): stage 1: ck/.step-00000002.tmp, which"),
            std::string::npos)
      << out;
  EXPECT_TRUE(fs::is_empty(dir / "a/ck"));  // no step folder, no temporary one, no latest
  EXPECT_EQ(out.find("checkpoint written"), std::string::npos) << out;
}

// A node killed mid-run: the coordinator notices, aborts the step and ends the job with
// an error naming the node, within seconds (no hang).
TEST(MultiProcessFaults, KilledNodeIsNoticedWithinSeconds) {
  test::temp_dir dir;
  auto group = start({2, {"--pipeline", "2", "--data-parallel", "2", "--steps", "2000", "--eval-interval", "0"}}, dir,
                     free_port());
  ASSERT_TRUE(group.wait_for_log(0, [](const std::string& s) { return s.find("3/2000 |") != std::string::npos; },
                                 std::chrono::seconds(120)))
      << group.log(0);
  group.signal(1, SIGKILL);
  const auto killed_at = std::chrono::steady_clock::now();
  const bool ended = group.wait_for_log(
      0, [](const std::string& s) { return s.find("troupe: error") != std::string::npos; }, std::chrono::seconds(30));
  const auto took = std::chrono::duration<double>(std::chrono::steady_clock::now() - killed_at).count();
  const auto results = group.wait(std::chrono::seconds(30));
  ASSERT_TRUE(ended) << results[0].output;
  EXPECT_LT(took, 20.0);
  EXPECT_EQ(results[0].status, troupe::exit_recoverable) << results[0].output;  // the launcher restarts it
  EXPECT_NE(results[0].output.find("node 1 is gone"), std::string::npos) << results[0].output;
}
