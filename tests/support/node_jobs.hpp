#pragma once
// Node-process jobs for the multi-process tests (multiprocess_*_test.cpp): troupe-node
// processes on this machine, started through process_group (none is left behind), and
// the comparison of what they wrote with the same job run in this process.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "actors/runtime.hpp"
#include "compute/checkpoint/checkpoint.hpp"
#include "process_group.hpp"
#include "test_util.hpp"
#include "build_paths.hpp"

namespace troupe::test {

inline const std::string node_binary = std::filesystem::path(troupe::test::troupe_binary).parent_path() / "troupe-node";

inline int free_port() {
  static int next = 24000 + (getpid() % 4000) * 2;  // distinct per test process (one counter in all files)
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

inline process_group start(const job& j, const temp_dir& dir, int port) {
  return process_group(
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

/// Runs `cfg` in this process (saving DIR/single.pt) and expects what the node processes
/// wrote to be exactly its: DIR/multi.pt and its moments, and the final evaluation's loss
/// on the last line of DIR/multi.jsonl.
inline void expect_the_in_process_run(job_config cfg, const temp_dir& dir, const std::string& at) {
  cfg.save = dir / "single.pt";
  actor_run_options quiet;
  quiet.quiet = true;
  const auto single = run_actor_training(cfg, quiet);
  ASSERT_EQ(single.exit_code, 0) << at << ": " << single.error;
  EXPECT_EQ(max_abs_diff(load_state_dict(dir / "multi.pt"), load_state_dict(dir / "single.pt")), 0.0) << at;
  EXPECT_EQ(max_abs_diff(load_state_dict(dir / "multi.pt.optim"), load_state_dict(dir / "single.pt.optim")), 0.0)
      << at;
  ASSERT_EQ(single.evaluations.size(), 1u) << at;
  std::ifstream metrics(dir / "multi.jsonl");
  std::string line, last;
  while (std::getline(metrics, line)) last = line;
  const auto j = nlohmann::json::parse(last);
  ASSERT_TRUE(j.contains("val_loss")) << last;
  EXPECT_EQ(j.at("val_loss").get<double>(), single.evaluations[0].loss) << at;
}

}  // namespace troupe::test
