// The local loop split over T tensor-parallel ranks equals the unsplit run after ten steps
// (WORKLOADS.md's equivalence rule).
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

state_dict train(const job_config& c, std::vector<double>* losses = nullptr) {
  local_trainer t(c, std::nullopt, in_process_groups);
  for (int i = 0; i < c.steps; ++i) {
    const auto st = t.step();
    if (losses) losses->push_back(st.loss);
  }
  return t.state();
}

class TensorParallelTraining : public ::testing::TestWithParam<tp_layout> {};

}  // namespace

TEST_P(TensorParallelTraining, ParametersEqualTheUnsplitRunAfterTenSteps) {
  const auto l = GetParam();
  const auto base = small_job(l.workload);
  std::vector<double> ref_losses, losses;
  const auto ref = test::shared_reference(std::string("tp-unsplit-") + l.workload, [&](std::vector<double>* out) {
    return train(base, out);
  }, &ref_losses);
  const auto c = with_layout(base, l);
  const auto got = train(c, &losses);
  EXPECT_LE(test::max_abs_diff(got, ref), 1e-5) << name_of(l);
  ASSERT_EQ(losses.size(), ref_losses.size());
  for (std::size_t i = 0; i < losses.size(); ++i) EXPECT_NEAR(losses[i], ref_losses[i], 1e-5) << "step " << i;
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, TensorParallelTraining,
    ::testing::Values(
        // gpt2: T x SP x P x D
        tp_layout{2, 1, 1, false, "gpt-tiny", "1f1b", "none"}, tp_layout{2, 1, 1, true, "gpt-tiny", "1f1b", "none"},
        tp_layout{4, 1, 1, false, "gpt-tiny", "1f1b", "none"}, tp_layout{4, 1, 1, true, "gpt-tiny", "1f1b", "none"},
        tp_layout{2, 2, 1, false, "gpt-tiny", "1f1b", "none"}, tp_layout{2, 2, 1, true, "gpt-tiny", "1f1b", "none"},
        tp_layout{2, 1, 2, false, "gpt-tiny", "1f1b", "none"}, tp_layout{2, 1, 2, true, "gpt-tiny", "1f1b", "none"},
        tp_layout{4, 2, 2, false, "gpt-tiny", "1f1b", "none"}, tp_layout{4, 2, 2, true, "gpt-tiny", "1f1b", "none"},
        tp_layout{2, 2, 2, true, "gpt-tiny", "gpipe", "none"},
        // every schedule kind and recompute mode with sequence parallelism
        tp_layout{2, 2, 1, true, "gpt-tiny", "zero-bubble", "none"},
        tp_layout{2, 2, 1, true, "gpt-tiny", "interleaved-1f1b", "none"},
        tp_layout{2, 2, 1, true, "gpt-tiny", "1f1b", "full"}, tp_layout{2, 1, 1, true, "gpt-tiny", "1f1b", "selective"},
        // llama (2 key/value heads: T = 2; T = 4 replicates them, each copy's gradient summed)
        tp_layout{2, 1, 1, false, "llama-tiny", "1f1b", "none"}, tp_layout{2, 1, 1, true, "llama-tiny", "1f1b", "none"},
        tp_layout{2, 2, 2, true, "llama-tiny", "1f1b", "none"}, tp_layout{2, 2, 1, false, "llama-tiny", "zero-bubble", "full"},
        tp_layout{4, 1, 1, false, "llama-tiny", "1f1b", "none"}, tp_layout{4, 2, 1, true, "llama-tiny", "zero-bubble", "none"}),
    [](const ::testing::TestParamInfo<tp_layout>& info) { return name_of(info.param); });

}  // namespace troupe
