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

class FamilyLayouts : public ::testing::TestWithParam<keyed_layout> {};

}  // namespace

TEST_P(FamilyLayouts, SameParametersAndLossesAsTheOneProcessLoop) {
  auto c = llama_config(200);  // the small llama-tiny (d_model 64, seq_len 64)
  c.microbatches = 4;
  expect_one_process_result(c, GetParam().keys, GetParam().name);
}

INSTANTIATE_TEST_SUITE_P(
    Families, FamilyLayouts,
    ::testing::Values(
        keyed_layout{"mistral_window16_p2_d2_zero_bubble",
                     {{"architecture", "mistral"}, {"sliding_window", "16"}, {"pipeline", "2"}, {"data_parallel", "2"},
                      {"schedule", "zero-bubble"}}},
        keyed_layout{"qwen2_t2_p2_recompute_full",
                     {{"architecture", "qwen2"}, {"tensor_parallel", "2"}, {"pipeline", "2"}, {"recompute", "full"}}},
        // head_dim 24 (not 64 / 4); 4 ranks over 2 key/value heads replicate them
        keyed_layout{"qwen3_head24_t4_sp",
                     {{"architecture", "qwen3"}, {"head_dim", "24"}, {"tensor_parallel", "4"},
                      {"sequence_parallel", "true"}}},
        keyed_layout{"qwen3_head24_t2_p2_interleaved",
                     {{"architecture", "qwen3"}, {"head_dim", "24"}, {"tensor_parallel", "2"}, {"pipeline", "2"},
                      {"chunks", "2"}, {"schedule", "interleaved-1f1b"}}},
        keyed_layout{"qwen3_moe_d2_ep2_p2",
                     {{"workload", "moe-tiny"}, {"architecture", "qwen3"}, {"head_dim", "24"}, {"data_parallel", "2"},
                      {"expert_parallel", "2"}, {"pipeline", "2"}}}),
    [](const ::testing::TestParamInfo<keyed_layout>& info) { return std::string(info.param.name); });

}  // namespace troupe
