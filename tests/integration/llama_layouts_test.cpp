// llama-tiny through the actor runtime: every schedule kind, with a pipeline and
// replicas, gives the parameters and losses of the reference loop.
#include <gtest/gtest.h>

#include <fstream>

#include <nlohmann/json.hpp>

#include "actor_test_util.hpp"
#include "cached_forward.hpp"
#include "compute/trainer/generate.hpp"
#include "compute/checkpoint/hf_folder.hpp"
#include "compute/models/partition.hpp"
#include "quiet_run.hpp"

namespace troupe {

using namespace actor_test;

namespace {

const reference_run& llama_reference() {
  static const reference_run ref = [] {
    reference_run r;
    r.state = test::shared_reference(
        "actors-small-llama-tiny-reference-6-steps",
        [](std::vector<double>* losses) {
          auto run = reference_of(llama_config(200));
          *losses = run.losses;
          return run.state;
        },
        &r.losses);
    return r;
  }();
  return ref;
}

class LlamaLayouts : public ::testing::TestWithParam<layout> {};

}  // namespace

TEST_P(LlamaLayouts, SameParametersAndLossesAsTheReferenceLoop) {
  const auto l = GetParam();
  auto c = gpt_layout(l);
  c.workload = "llama-tiny";
  const auto got = run_actors(c);
  ASSERT_EQ(got.exit_code, 0) << got.error;
  const auto& ref = llama_reference();
  EXPECT_LE(test::max_abs_diff(got.final_state, ref.state), 1e-5) << name_of(l);
  EXPECT_GT(test::max_abs_diff(got.final_state, initial_state(c.model(), c.seed)), 1e-3) << "parameters did not move";
  ASSERT_EQ(got.losses.size(), ref.losses.size());
  for (std::size_t i = 0; i < ref.losses.size(); ++i) EXPECT_NEAR(got.losses[i], ref.losses[i], 1e-5) << "step " << i;
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, LlamaLayouts,
    // Every schedule kind, with a pipeline and replicas: zero-bubble's split backward
    // over the seven projections, dataflow's split W ops with gradient buckets.
    ::testing::Values(layout{4, 1, 1, "1f1b"}, layout{4, 2, 1, "gpipe"}, layout{2, 2, 2, "interleaved-1f1b"},
                      layout{4, 2, 1, "zero-bubble"}, layout{4, 2, 1, "dataflow", true, 20000}),
    [](const auto& info) { return name_of(info.param); });

}  // namespace troupe
