// A tensor-parallel checkpoint resumes with other widths.
#include <gtest/gtest.h>

#include <thread>

#include <torch/nn/functional.h>

#include "actors/tp_groups.hpp"
#include "ucx_groups.hpp"
#include "compute/parallel/tensor_parallel.hpp"
#include "compute/models/tensor_parallel_layout.hpp"
#include "compute/trainer/local_trainer.hpp"
#include "test_util.hpp"
#include "tp_test_util.hpp"


namespace troupe {

using namespace tp_test;

namespace {

/// `workload` trained 5 of 10 steps at width `width` (sequence parallel) and saved: the
/// file holds the whole model, and it resumes at each of `others` with the same
/// parameters, its next 5 steps following the saving run's within 1e-5.
void expect_resumes_in_other_widths(const std::string& workload, int width, std::initializer_list<int> others) {
  test::temp_dir dir;
  const auto path = dir / "tp.pt";
  auto job = small_job(workload);
  job.tensor_parallel = width;
  job.sequence_parallel = true;
  job.steps = 10;
  local_trainer first(job, std::nullopt, in_process_groups);
  for (int i = 0; i < 5; ++i) first.step();
  first.save_checkpoint(path);
  // The files hold the whole model, as the unsplit loop writes it.
  const auto saved = load_state_dict(path);
  check_state(job.model(), saved);
  EXPECT_EQ(test::max_abs_diff(saved, first.state()), 0.0);
  bool continued = false;
  for (int other : others) {
    auto c = job;
    c.tensor_parallel = other;
    c.load = path;
    local_trainer resumed(c, std::nullopt, in_process_groups);
    EXPECT_EQ(resumed.next_step(), 5);
    EXPECT_EQ(test::max_abs_diff(resumed.state(), saved), 0.0) << other;
    // ... and the optimizer state comes back whole: the next steps follow the saving run.
    for (int i = 5; i < 10; ++i) resumed.step();
    if (!continued) {
      for (int i = 5; i < 10; ++i) first.step();
      continued = true;
    }
    EXPECT_LE(test::max_abs_diff(resumed.state(), first.state()), 1e-5) << other;
  }
}

}  // namespace

TEST(TensorParallelCheckpoint, AWidthTwoCheckpointResumesWithWidthsOneAndFour) {
  expect_resumes_in_other_widths("gpt-tiny", 2, {1, 4});
}

// llama-tiny's 2 key/value heads over 4 ranks are replicated: the file holds them once,
// and widths 2 (split) and 1 take them up.
TEST(TensorParallelCheckpoint, ReplicatedKeyValueHeadsResumeWithWidthsTwoAndOne) {
  expect_resumes_in_other_widths("llama-tiny", 4, {2, 1});
}

}  // namespace troupe
