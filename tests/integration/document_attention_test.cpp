// --document-attention through the actor runtime: the documents' positions travel with
// the micro-batches and activations to every stage, and layouts of pipeline, tensor,
// sequence, context and expert parallelism, replicas, recomputation and schedules give the
// parameters and losses of the one-process loop; the evaluation in the pipeline gives the
// gathered model's. (The forward's semantics: tests/unit/document_attention_test.cpp; against
// transformers: tests/integration/tokenizer_client_test.cpp.)
#include <gtest/gtest.h>

#include <fstream>
#include <random>

#include <nlohmann/json.hpp>

#include "actor_test_util.hpp"
#include "compute/data/documents.hpp"
#include "small_tokenizer.hpp"

namespace troupe {

using namespace actor_test;

namespace {

/// A tokenizer folder (test::small_bpe, EOS </s>) and 400 JSON-lines documents of 2 to
/// 60 characters of "abcx!" (a few tokens to some 40): a window of 64 holds several.
struct documents {
  test::temp_dir dir;
  documents() {
    std::filesystem::create_directories(dir / "tok");
    std::ofstream(dir / "tok/tokenizer.json") << test::small_bpe().dump();
    std::ofstream(dir / "tok/tokenizer_config.json") << R"({"eos_token": "</s>"})";
    std::ofstream out(dir / "docs.jsonl");
    std::mt19937 rng(11);
    const std::string chars = "abcx!";
    for (int d = 0; d < 400; ++d) {
      std::string text(std::size_t(2 + rng() % 59), 'a');
      for (auto& ch : text) ch = chars[rng() % chars.size()];
      out << nlohmann::json{{"text", text}}.dump() << "\n";
    }
  }
  /// small llama-tiny (a layout's workload key may change it) on the documents.
  job_config job() const {
    auto c = test::small_config(200);
    c.workload = "llama-tiny";
    c.data = {dir / "docs.jsonl"};
    c.tokenizer = dir / "tok";
    c.cache_dir = dir / "cache";
    c.document_attention = true;
    c.microbatches = 4;
    return c;
  }
};

const documents& shared_documents() {
  static const documents d;
  return d;
}

class DocumentLayouts : public ::testing::TestWithParam<keyed_layout> {};

}  // namespace

TEST_P(DocumentLayouts, SameParametersAndLossesAsTheOneProcessLoop) {
  auto [one, ref] = expect_one_process_result(shared_documents().job(), GetParam().keys, GetParam().name);
  // The documents change what the model computes: one causal sequence per window trains
  // to other parameters.
  one.document_attention = false;
  EXPECT_GT(test::max_abs_diff(reference_of(one).state, ref.state), 1e-4) << GetParam().name;
}

INSTANTIATE_TEST_SUITE_P(
    Documents, DocumentLayouts,
    ::testing::Values(
        keyed_layout{"llama_t2_sp_p2_recompute_full",
                     {{"tensor_parallel", "2"}, {"sequence_parallel", "true"}, {"pipeline", "2"}, {"recompute", "full"}}},
        keyed_layout{"llama_p2_v2_interleaved_recompute_selective",
                     {{"pipeline", "2"}, {"chunks", "2"}, {"schedule", "interleaved-1f1b"}, {"recompute", "selective"}}},
        keyed_layout{"gpt_t2_sp_d2_zero_bubble",
                     {{"workload", "gpt-tiny"}, {"tensor_parallel", "2"}, {"sequence_parallel", "true"},
                      {"pipeline", "2"}, {"data_parallel", "2"}, {"schedule", "zero-bubble"}}},
        // (a forward on a second thread beside a backward that reruns its blocks)
        keyed_layout{"moe_d2_ep2_p2_v2_combined_recompute_full",
                     {{"workload", "moe-tiny"}, {"data_parallel", "2"}, {"expert_parallel", "2"}, {"pipeline", "2"},
                      {"chunks", "2"}, {"schedule", "combined-1f1b"}, {"recompute", "full"}}},
        // Context parallelism: each rank's tokens at their document positions, the group's
        // core masked by the tokens' document numbers in the whole sequence.
        keyed_layout{"llama_c2_p2p_p2_recompute_full",
                     {{"context_parallel", "2"}, {"pipeline", "2"}, {"recompute", "full"}}},
        keyed_layout{"llama_c4_a2a_d2",
                     {{"context_parallel", "4"}, {"context_parallel_comm", "a2a"}, {"data_parallel", "2"}}},
        keyed_layout{"gpt_c2_allgather_t2_sp",
                     {{"workload", "gpt-tiny"}, {"context_parallel", "2"}, {"context_parallel_comm", "allgather"},
                      {"tensor_parallel", "2"}, {"sequence_parallel", "true"}}}),
    [](const ::testing::TestParamInfo<keyed_layout>& info) { return std::string(info.param.name); });

// The validation windows' positions go to the first stage with their rows and on with the
// activations: the pipeline's evaluation gives the gathered model's.
TEST(DocumentAttention, ThePipelinesEvaluationGivesTheGatheredModels) {
  auto c = shared_documents().job();
  c.pipeline = 2;
  c.steps = 2;
  c.eval_interval = 2;
  c.eval_tokens = 512;
  c.eval_mode = "gather";
  const auto gathered = run_actors(c);
  c.eval_mode = "pipeline";
  const auto piped = run_actors(c);
  ASSERT_EQ(gathered.exit_code, 0) << gathered.error;
  ASSERT_EQ(piped.exit_code, 0) << piped.error;
  ASSERT_EQ(piped.evaluations.size(), 1u);
  ASSERT_EQ(gathered.evaluations.size(), 1u);
  EXPECT_NEAR(piped.evaluations[0].loss, gathered.evaluations[0].loss, 1e-6);
}

TEST(DocumentAttention, JobsWithoutDocumentsOrTheirEosAreRefused) {
  auto c = test::small_config(1);
  c.document_attention = true;
  EXPECT_NE(test::config_error_of(c).find("document_attention resets attention at the documents of --data"),
            std::string::npos)
      << test::config_error_of(c);
  // A Megatron dataset's ids need no tokenizer, but its documents' EOS must be known.
  test::temp_dir dir;
  {
    megatron_writer w(dir / "ids", 256);
    w.add_document({5, 6, 7});
    w.finish();
  }
  c.data = {dir / "ids"};
  EXPECT_NE(test::config_error_of(c).find("document_attention needs the documents' EOS token"), std::string::npos)
      << test::config_error_of(c);
  c.document_attention = false;
  EXPECT_EQ(test::config_error_of(c), "");
  // A tokenizer without EOS (a tokenizer.json without a tokenizer_config.json beside it).
  c.document_attention = true;
  std::ofstream(dir / "tokenizer.json") << test::small_bpe().dump();
  c.tokenizer = dir / "tokenizer.json";
  EXPECT_NE(test::config_error_of(c).find("has no EOS token"), std::string::npos) << test::config_error_of(c);
  c.tokenizer = shared_documents().dir / "tok";
  EXPECT_EQ(test::config_error_of(c), "");
}

}  // namespace troupe
