// Expert parallelism over node processes: exactly the in-process run.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

#include "actors/runtime.hpp"
#include "compute/checkpoint/checkpoint.hpp"
#include "node_jobs.hpp"

using namespace troupe;
using test::free_port;
using test::start;
using test::expect_the_in_process_run;

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
