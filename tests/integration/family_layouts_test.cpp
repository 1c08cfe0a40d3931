// Llama's relatives (compute/models/family.cpp) through the actor runtime, from the
// [model] keys alone: mistral with a sliding window shorter than the sequence, qwen2's
// biases, qwen3's head norms and head_dim, qwen3 with experts (Qwen3-MoE) each in a layout
// of pipeline, tensor and sequence parallelism, replicas, experts and schedules that
// uses what the family adds, give the parameters and losses of the one-process loop.
// (Against transformers itself: hf_client_test.cpp.)
#include <gtest/gtest.h>

#include "actor_test_util.hpp"

namespace troupe {

using namespace actor_test;

namespace {

struct family_layout {
  const char* name;
  std::vector<std::pair<std::string, std::string>> keys;
};

void PrintTo(const family_layout& l, std::ostream* os) { *os << l.name; }

class FamilyLayouts : public ::testing::TestWithParam<family_layout> {};

}  // namespace

TEST_P(FamilyLayouts, SameParametersAndLossesAsTheOneProcessLoop) {
  const auto& l = GetParam();
  auto c = llama_config(200);  // the small llama-tiny (d_model 64, seq_len 64)
  c.microbatches = 4;
  for (const auto& [key, value] : l.keys) c.set(key, value, "test");
  c.validate();
  auto one = c;  // the one-process loop: no group of any kind
  one.tensor_parallel = one.expert_parallel = 1;
  one.sequence_parallel = false;
  one.recompute = "none";
  const auto ref = reference_of(one);
  const auto got = run_actors(c);
  ASSERT_EQ(got.exit_code, 0) << got.error;
  EXPECT_LE(test::max_abs_diff(got.final_state, ref.state), 1e-5) << l.name;
  EXPECT_GT(test::max_abs_diff(got.final_state, initial_state(c.model(), c.seed)), 1e-3) << "parameters did not move";
  ASSERT_EQ(got.losses.size(), ref.losses.size());
  for (std::size_t i = 0; i < ref.losses.size(); ++i) EXPECT_NEAR(got.losses[i], ref.losses[i], 1e-5) << "step " << i;
}

INSTANTIATE_TEST_SUITE_P(
    Families, FamilyLayouts,
    ::testing::Values(
        family_layout{"mistral_window16_p2_d2_zero_bubble",
                      {{"architecture", "mistral"}, {"sliding_window", "16"}, {"pipeline", "2"}, {"data_parallel", "2"},
                       {"schedule", "zero-bubble"}}},
        family_layout{"qwen2_t2_p2_recompute_full",
                      {{"architecture", "qwen2"}, {"tensor_parallel", "2"}, {"pipeline", "2"}, {"recompute", "full"}}},
        // head_dim 24 (not 64 / 4); 4 ranks over 2 key/value heads replicate them
        family_layout{"qwen3_head24_t4_sp",
                      {{"architecture", "qwen3"}, {"head_dim", "24"}, {"tensor_parallel", "4"},
                       {"sequence_parallel", "true"}}},
        family_layout{"qwen3_head24_t2_p2_interleaved",
                      {{"architecture", "qwen3"}, {"head_dim", "24"}, {"tensor_parallel", "2"}, {"pipeline", "2"},
                       {"chunks", "2"}, {"schedule", "interleaved-1f1b"}}},
        family_layout{"qwen3_moe_d2_ep2_p2",
                      {{"workload", "moe-tiny"}, {"architecture", "qwen3"}, {"head_dim", "24"}, {"data_parallel", "2"},
                       {"expert_parallel", "2"}, {"pipeline", "2"}}}),
    [](const ::testing::TestParamInfo<family_layout>& info) { return std::string(info.param.name); });

}  // namespace troupe
