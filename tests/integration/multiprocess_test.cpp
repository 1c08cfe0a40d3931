// Node processes (troupe-node) on this machine give exactly the parameters, optimizer
// state, checkpoint folder and evaluation of the in-process actor run, one layout per
// dimension.
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
using test::job;
using test::expect_the_in_process_run;

namespace {

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
                                       "--bucket-size", std::to_string(bucket_size),
                                       "--d-model", "64", "--seq-len", "64"};  // test::small_config
  auto args = flags;
  args.insert(args.end(), {"--save", dir / "multi.pt", "--metrics", dir / "multi.jsonl", "--eval-tokens", "1024",
                           "--checkpoint-dir", dir / "ck"});
  auto group = start({nodes, args}, dir, free_port());
  const auto results = group.wait(std::chrono::seconds(300));
  for (int i = 0; i < nodes; ++i) ASSERT_EQ(results[i].status, 0) << "node " << i << ":\n" << results[i].output;
  EXPECT_NE(results[0].output.find("step 10/10"), std::string::npos) << results[0].output;

  auto cfg = test::small_config(10);
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
