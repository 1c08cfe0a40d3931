// llama-tiny over node processes against plain PyTorch.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

#include "actors/runtime.hpp"
#include "compute/checkpoint/checkpoint.hpp"
#include "node_jobs.hpp"
#include "build_paths.hpp"

using namespace troupe;
using test::free_port;
using test::start;

// llama-tiny over node processes against plain PyTorch (tests/support/python/
// gpt_reference.py --workload llama-tiny): from the same torch.save(model.state_dict())
// init, a 5-step run of p2 x d2 on 2 nodes gives the losses and the parameters of
// PyTorch's loop within 1e-5.
TEST(MultiProcessLlama, NodesFollowPlainPytorch) {
  test::temp_dir dir;
  constexpr int steps = 5;
  const std::string cmd = std::string("/usr/bin/python3 ") + troupe::test::source_dir +
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
