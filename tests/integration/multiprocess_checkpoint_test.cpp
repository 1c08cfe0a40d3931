// Checkpoint folders written by node processes that do not share the folder: none is
// written, with the reason.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "actors/runtime.hpp"
#include "compute/checkpoint/checkpoint.hpp"
#include "node_jobs.hpp"

using namespace troupe;
using test::free_port;
using test::start;
using test::job;

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
  std::vector<std::string> left;  // no step folder, no temporary one, no latest: the job's lock only
  for (const auto& e : fs::directory_iterator(dir / "a/ck")) left.push_back(e.path().filename());
  EXPECT_EQ(left, std::vector<std::string>{".lock"});
  EXPECT_EQ(out.find("checkpoint written"), std::string::npos) << out;
}
