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

TEST(TensorParallelCheckpoint, AWidthTwoCheckpointResumesWithWidthsOneAndFour) {
  test::temp_dir dir;
  const auto path = dir / "tp2.pt";
  auto two = small_job();
  two.tensor_parallel = 2;
  two.sequence_parallel = true;
  two.steps = 10;
  local_trainer first(two, std::nullopt, in_process_groups);
  for (int i = 0; i < 5; ++i) first.step();
  first.save_checkpoint(path);
  // The files hold the whole model, as the unsplit loop writes it.
  const auto saved = load_state_dict(path);
  check_state(two.model(), saved);
  EXPECT_EQ(test::max_abs_diff(saved, first.state()), 0.0);
  for (int width : {1, 4}) {
    auto c = two;
    c.tensor_parallel = width;
    c.load = path;
    local_trainer resumed(c, std::nullopt, in_process_groups);
    EXPECT_EQ(resumed.next_step(), 5);
    EXPECT_EQ(test::max_abs_diff(resumed.state(), saved), 0.0) << width;
    // ... and the optimizer state comes back whole: the next steps follow the width-2 run.
    for (int i = 5; i < 10; ++i) resumed.step();
    if (width == 1) {
      for (int i = 5; i < 10; ++i) first.step();
    }
    EXPECT_LE(test::max_abs_diff(resumed.state(), first.state()), 1e-5) << width;
  }
}

}  // namespace troupe
