// moe-tiny (WORKLOADS.md section 4) in the actor runtime: every kind of layout follows the
// plain loop; Mixtral's names; bad settings say what is wrong. Against plain PyTorch:
// tests/unit/pipeline_test.cpp (PytorchReference); expert parallelism:
// tests/unit/expert_parallel_test.cpp.
#include <gtest/gtest.h>

#include <fstream>

#include <nlohmann/json.hpp>

#include "actor_test_util.hpp"
#include "compute/models/partition.hpp"
#include "quiet_run.hpp"

namespace troupe {

using namespace actor_test;

// moe-tiny's experts in the actor runtime: every kind of layout (replicas, zero-bubble's
// split backward through the router and the experts, dataflow with gradient buckets that
// an expert without tokens leaves without gradient) follows the plain loop, bf16 follows
// fp32, and full recomputation (the router runs again) changes no bit and counts the
// load-balancing loss once.
TEST(Moe, ActorLayoutsFollowThePlainLoop) {
  auto c = test::gpt_config(200);
  c.workload = "moe-tiny";
  c.layers = 4;
  c.d_model = 64;
  c.seq_len = 32;
  c.eval_interval = 0;
  const auto ref = reference_of(c);
  test::temp_dir dir;
  for (const auto& l : {layout{2, 2, 1, "1f1b"}, layout{2, 1, 1, "zero-bubble"}, layout{2, 2, 1, "dataflow", true, 20000}}) {
    auto a = c;
    a.metrics = dir / (name_of(l) + ".jsonl");
    a.pipeline = l.p;
    a.data_parallel = l.d;
    a.schedule = l.schedule;
    a.split_backward = l.split_backward;
    a.bucket_size = l.bucket_size;
    const auto got = run_actors(a);
    ASSERT_EQ(got.exit_code, 0) << got.error;
    EXPECT_LE(test::max_abs_diff(got.final_state, ref.state), 1e-5) << name_of(l);
    for (std::size_t i = 0; i < ref.losses.size(); ++i) EXPECT_NEAR(got.losses[i], ref.losses[i], 1e-5) << "step " << i;
    // The load-balancing loss every stage added, summed by the coordinator: the plain loop's.
    std::ifstream metrics(a.metrics);
    std::string first;
    std::getline(metrics, first);
    auto plain = c;
    plain.runtime = "local";
    local_trainer one(plain);
    const auto plain_step = one.step();
    const auto metrics_line = nlohmann::json::parse(first);
    EXPECT_NEAR(metrics_line.at("aux_loss").get<double>(), plain_step.aux_loss, 1e-6) << name_of(l);
    // Tokens per expert per layer, summed by the coordinator over stages and replicas.
    const auto [fewest, most] = expert_token_range(plain_step.expert_tokens);
    EXPECT_EQ(metrics_line.at("expert_tokens_min").get<std::vector<std::int64_t>>(), fewest) << name_of(l);
    EXPECT_EQ(metrics_line.at("expert_tokens_max").get<std::vector<std::int64_t>>(), most) << name_of(l);
    EXPECT_EQ(most.size(), std::size_t(c.layers));
  }
  // bf16: the experts compute under autocast, their outputs add up in fp32.
  auto bf16 = c;
  bf16.precision = "bf16";
  bf16.pipeline = 2;
  const auto low = run_actors(bf16);
  ASSERT_EQ(low.exit_code, 0) << low.error;
  for (std::size_t i = 0; i < ref.losses.size(); ++i) EXPECT_NEAR(low.losses[i], ref.losses[i], 0.03) << "bf16 step " << i;
  auto local = c;
  local.runtime = "local";
  local.pipeline = 2;
  local_trainer plain(local);
  local.recompute = "full";
  local_trainer recomputed(local);
  for (int i = 0; i < 3; ++i) {
    const auto a = plain.step(), b = recomputed.step();
    EXPECT_EQ(a.loss, b.loss);
    EXPECT_GT(a.aux_loss, 0.0);
    EXPECT_EQ(a.aux_loss, b.aux_loss) << "step " << i;
  }
  EXPECT_EQ(test::max_abs_diff(plain.state(), recomputed.state()), 0.0);
}

}  // namespace troupe

namespace troupe {

TEST(Moe, NamesAreMixtralsAndBadSettingsSaySo) {
  const auto spec = job_config::defaults_for("moe-tiny").model();
  const auto names = parameter_names(spec);
  for (const char* name : {"model.layers.0.block_sparse_moe.gate.weight", "model.layers.7.block_sparse_moe.experts.3.w1.weight",
                           "model.layers.7.block_sparse_moe.experts.3.w2.weight"})
    EXPECT_NE(std::find(names.begin(), names.end(), name), names.end()) << name;
  EXPECT_EQ(std::find(names.begin(), names.end(), "model.layers.0.mlp.up_proj.weight"), names.end());
  const auto init = initial_state(spec, 1);
  for (const auto& [name, t] : init)
    if (name == "model.layers.0.block_sparse_moe.experts.2.w3.weight") EXPECT_EQ(t.sizes(), (c10::IntArrayRef{192, 128}));
  const auto error_of = test::config_error_of;
  auto gpt = job_config::defaults_for("gpt-tiny");
  gpt.experts = 4;
  EXPECT_NE(error_of(gpt).find("experts 4 with architecture gpt2: the mixture of experts is Mixtral's"), std::string::npos) << error_of(gpt);
  auto moe = job_config::defaults_for("moe-tiny");
  moe.moe_top_k = 5;
  EXPECT_NE(error_of(moe).find("moe_top_k 5 with 4 experts: expected 1 to 4"), std::string::npos) << error_of(moe);
  moe.moe_top_k = 0;
  moe.runtime = "local";
  moe.tensor_parallel = 2;
  EXPECT_NE(error_of(moe).find("experts with tensor_parallel 2 need sequence_parallel = true"), std::string::npos)
      << error_of(moe);
}

}  // namespace troupe
