// Tensor-parallel groups over UCX communicators give the in-process groups' bits.
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

/// Tensor-parallel groups over UCX (shared memory between the threads of this process):
/// what node processes would use between processes.
TEST(TensorParallelOverUcx, GroupsOfUcxCommunicatorsGiveTheInProcessGroupsBits) {
  const group_factory ucx = test::ucx_groups;
  auto c = small_job("llama-tiny");
  c.tensor_parallel = 2;
  c.sequence_parallel = true;
  c.pipeline = 2;
  local_trainer over_ucx(c, std::nullopt, ucx), in_process(c, std::nullopt, in_process_groups);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(over_ucx.step().loss, in_process.step().loss) << "step " << i;
  EXPECT_EQ(test::max_abs_diff(over_ucx.state(), in_process.state()), 0.0);
}

}  // namespace troupe
