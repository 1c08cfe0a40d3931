// fmnist-mlp (WORKLOADS.md): one epoch of the local loop reaches its accuracy, and a
// pipelined, data-parallel run equals one process.
#include <gtest/gtest.h>

#include "compute/trainer/local_trainer.hpp"
#include "local_training.hpp"
#include "test_util.hpp"

namespace troupe {

using test::train;

TEST(FmnistMlp, OneEpochReachesEightyThreePercent) {
  auto c = job_config::defaults_for("fmnist-mlp");
  local_trainer t(c);
  const double before = t.evaluate().accuracy;
  while (t.next_step() < c.steps) t.step();
  const double acc = t.evaluate().accuracy;
  EXPECT_GE(acc, 0.83) << "test accuracy after one epoch";
  EXPECT_LT(before, 0.3);
}

TEST(FmnistMlp, TwoStagesTwoReplicasEqualOneProcess) {
  auto c = job_config::defaults_for("fmnist-mlp");
  c.steps = 20;
  const auto one = train(c, 20);
  c.pipeline = 2;
  c.data_parallel = 2;
  c.microbatches = 2;
  EXPECT_LE(test::max_abs_diff(train(c, 20), one), 1e-5);
}

}  // namespace troupe
