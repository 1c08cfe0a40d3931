#include <gtest/gtest.h>

#include <fstream>

#include "compute/config/job_config.hpp"
#include "compute/models/model.hpp"
#include "test_util.hpp"

namespace troupe {

namespace {
std::string write(const test::temp_dir& dir, const std::string& text) {
  const auto path = dir / "job.toml";
  std::ofstream(path) << text;
  return path;
}
std::string error_of(const std::string& path, std::vector<std::pair<std::string, std::string>> overrides = {}) {
  try {
    load_job_config(path, overrides);
  } catch (const config_error& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(JobConfig, WorkloadDefaults) {
  const auto gpt = load_job_config("", {});
  EXPECT_EQ(gpt.steps, 200);
  EXPECT_EQ(gpt.microbatch_size(), 4);
  const auto mlp = load_job_config("", {{"workload", "fmnist-mlp"}});
  EXPECT_EQ(mlp.steps, 937);
  EXPECT_EQ(mlp.microbatch_size(), 16);
  EXPECT_EQ(mlp.weight_decay, 0.0);
  EXPECT_EQ(mlp.beta2, 0.999);
}

TEST(JobConfig, FlagsOverrideTheFileWhichOverridesDefaults) {
  test::temp_dir dir;
  const auto path = write(dir, "[train]\nsteps = 50\nseed = 7\n[parallel]\npipeline = 2\nmicrobatches = 4\n"
                               "[optimizer]\nlr = 3e-4\n");
  const auto c = load_job_config(path, {{"steps", "20"}, {"parallel.data_parallel", "2"}});
  EXPECT_EQ(c.steps, 20);
  EXPECT_EQ(c.seed, 7u);
  EXPECT_EQ(c.pipeline, 2);
  EXPECT_EQ(c.data_parallel, 2);
  EXPECT_DOUBLE_EQ(c.lr, 3e-4);
  EXPECT_EQ(c.min_lr, 1e-4);
  // A file's workload picks that workload's defaults before the file's own keys.
  const auto mlp = load_job_config(write(dir, "[train]\nworkload = \"fmnist-mlp\"\nsteps = 10\n"), {});
  EXPECT_EQ(mlp.global_batch, 64);
  EXPECT_EQ(mlp.steps, 10);
  // The printed config reads back to the same values.
  const auto again = load_job_config(write(dir, c.to_toml()), {});
  EXPECT_EQ(again.to_toml(), c.to_toml());
}

TEST(JobConfig, BadInputGivesErrorsThatNameTheProblem) {
  test::temp_dir dir;
  EXPECT_NE(error_of(write(dir, "[train]\nstepz = 3\n")).find("unknown configuration key 'train.stepz'"), std::string::npos);
  EXPECT_NE(error_of("", {{"steps", "ten"}}).find("train.steps = 'ten': expected an integer"), std::string::npos);
  EXPECT_NE(error_of("", {{"steps", "-1"}}).find("train.steps"), std::string::npos);
  EXPECT_NE(error_of(write(dir, "[train\nsteps = 3\n")).find("line 1"), std::string::npos)
      << error_of(write(dir, "[train\nsteps = 3\n"));
  EXPECT_NE(error_of("", {{"microbatches", "5"}}).find("not divisible"), std::string::npos);
  EXPECT_NE(error_of("", {{"schedule", "interleaved-1f1b"}, {"pipeline", "3"}, {"chunks", "2"}})
                .find("multiple of stages"),
            std::string::npos);
  EXPECT_NE(error_of("", {{"pipeline", "16"}}).find("too few"), std::string::npos);
  EXPECT_NE(error_of("", {{"workload", "resnet"}}).find("unknown workload"), std::string::npos);
  EXPECT_NE(error_of("", {{"split", "3,3"}, {"pipeline", "2"}}).find("split"), std::string::npos);
  EXPECT_NE(error_of("", {{"lr", "nan"}}).find("optimizer.lr"), std::string::npos);
  EXPECT_EQ(error_of("", {{"split", "3,5"}, {"pipeline", "2"}}), "");
  EXPECT_NE(error_of("", {{"recompute", "partial"}}).find("unknown recompute 'partial' (expected none, selective or full)"),
            std::string::npos);
  EXPECT_NE(error_of("", {{"recompute", "selective"}, {"workload", "fmnist-mlp"}}).find("fmnist-mlp has none"),
            std::string::npos);
  EXPECT_EQ(error_of("", {{"recompute", "selective"}}), "");
  EXPECT_NE(error_of("", {{"recompute", "full"}, {"workload", "fmnist-mlp"}}).find("fmnist-mlp has none"),
            std::string::npos);
  EXPECT_EQ(error_of("", {{"recompute", "full"}}), "");
  EXPECT_NE(error_of("", {{"fp32_residual", "no"}}).find("train.fp32_residual = 'no': expected true or false"),
            std::string::npos);
}

// [model]: the gpt shape, from the file or flags; d_ff follows d_model unless set.
TEST(JobConfig, ModelKeysShapeTheGptWorkloads) {
  test::temp_dir dir;
  const auto path = write(dir, "[model]\nlayers = 3\nheads = 8\nd_model = 96\n");
  const auto c = load_job_config(path, {{"seq_len", "32"}, {"model.heads", "6"}});
  const auto g = c.model().decoder;
  EXPECT_EQ(g.n_layer, 3);
  EXPECT_EQ(g.n_head, 6);  // the flag over the file
  EXPECT_EQ(g.d_model, 96);
  EXPECT_EQ(g.d_ff, 4 * 96);
  EXPECT_EQ(g.seq_len, 32);
  EXPECT_EQ(g.vocab, 256);
  EXPECT_EQ(c.model().n_layers(), 3);
  EXPECT_EQ(load_job_config(path, {{"d_ff", "200"}}).model().decoder.d_ff, 200);
  // parameter_count against GPT-2's formula: V d + T d + L (4 d^2 + 2 d f + 9 d + f) + 2 d.
  auto formula = [](std::int64_t V, std::int64_t T, std::int64_t L, std::int64_t d, std::int64_t f) {
    return V * d + T * d + L * (4 * d * d + 2 * d * f + 9 * d + f) + 2 * d;
  };
  EXPECT_EQ(parameter_count(c.model()), formula(256, 32, 3, 96, 384));
  EXPECT_EQ(parameter_count(load_job_config("", {}).model()), formula(256, 128, 8, 128, 512));
  EXPECT_EQ(parameter_count(load_job_config("", {{"workload", "gpt-small"}}).model()), formula(256, 1024, 12, 768, 3072));
  // The label names the shape only when it differs from the workload's.
  EXPECT_EQ(load_job_config("", {}).model_label(), "gpt-tiny");
  EXPECT_EQ(c.model_label(), "gpt-tiny (gpt2, 3 layers, d_model 96, 6 heads, d_ff 384, seq_len 32: 0.36 M parameters)");
  // gpt-small's shape with fewer layers.
  const auto s = load_job_config("", {{"workload", "gpt-small"}, {"layers", "2"}}).model().decoder;
  EXPECT_EQ(s.n_layer, 2);
  EXPECT_EQ(s.d_model, 768);
  EXPECT_EQ(s.d_ff, 3072);
  EXPECT_EQ(s.seq_len, 1024);
  // Refusals.
  EXPECT_NE(error_of("", {{"heads", "5"}}).find("d_model 128 is not a multiple of heads (5)"), std::string::npos);
  EXPECT_NE(error_of("", {{"d_model", "90"}}).find("d_model 90 is not a multiple of heads (4)"), std::string::npos);
  EXPECT_NE(error_of("", {{"workload", "fmnist-mlp"}, {"layers", "3"}}).find("fmnist-mlp's layers are fixed"),
            std::string::npos);
  EXPECT_NE(error_of("", {{"layers", "2"}, {"pipeline", "3"}}).find("gpt-tiny has 2 layers, too few for 3 stages"),
            std::string::npos);
  EXPECT_NE(error_of("", {{"heads", "-1"}}).find("model.heads"), std::string::npos);
}

// The llama workloads and the architecture keys: WORKLOADS.md's shapes, parameter counts
// by formula, defaults that follow the workload, and each bad combination refused.
TEST(JobConfig, LlamaWorkloadsAndArchitectureKeys) {
  const auto tiny = load_job_config("", {{"workload", "llama-tiny"}}).model();
  ASSERT_TRUE(tiny.is_llama());
  const auto& g = tiny.decoder;
  EXPECT_EQ(std::vector<int>({g.n_layer, g.n_head, g.kv_heads(), g.d_model, g.head_dim(), g.d_ff, g.seq_len, g.vocab}),
            std::vector<int>({8, 4, 2, 128, 32, 384, 128, 256}));
  EXPECT_FALSE(g.tie_embeddings);
  EXPECT_EQ(g.rope_theta, 10000);
  EXPECT_EQ(g.norm_eps, 1e-5);
  // embed_tokens + L (2 norms + q, k, v, o + gate, up, down) + norm + lm_head.
  auto formula = [](std::int64_t V, std::int64_t L, std::int64_t d, std::int64_t H, std::int64_t KV, std::int64_t f) {
    const std::int64_t hd = d / H;
    return V * d + L * (2 * d + 2 * d * H * hd + 2 * d * KV * hd + 3 * d * f) + d + V * d;
  };
  EXPECT_EQ(parameter_count(tiny), formula(256, 8, 128, 4, 2, 384));
  const auto small = load_job_config("", {{"workload", "llama-small"}}).model();
  EXPECT_EQ(parameter_count(small), formula(256, 12, 768, 12, 4, 2048));
  EXPECT_EQ(small.decoder.seq_len, 1024);
  // d_ff follows d_model (3 x for llama-tiny); tie_embeddings ties lm_head to the embedding.
  const auto wide = load_job_config("", {{"workload", "llama-tiny"}, {"d_model", "256"}, {"heads", "8"}}).model();
  EXPECT_EQ(wide.decoder.d_ff, 768);
  EXPECT_EQ(wide.decoder.kv_heads(), 2);
  const auto tied = load_job_config("", {{"workload", "llama-tiny"}, {"tie_embeddings", "true"}}).model();
  EXPECT_EQ(parameter_count(tied), formula(256, 8, 128, 4, 2, 384) - 256 * 128);
  EXPECT_EQ(tied_parameter(tied), "model.embed_tokens.weight");
  // The architecture key on a gpt workload: a llama of gpt-tiny's shape.
  const auto arch = load_job_config("", {{"architecture", "llama"}}).model();
  EXPECT_TRUE(arch.is_llama());
  EXPECT_EQ(arch.decoder.kv_heads(), 4);
  EXPECT_EQ(arch.decoder.d_ff, 512);
  EXPECT_EQ(load_job_config("", {{"workload", "llama-tiny"}, {"kv_heads", "1"}}).model_label(),
            "llama-tiny (llama, 8 layers, d_model 128, 4 heads, 1 kv heads, d_ff 384, seq_len 128: 1.58 M parameters)");
  // Refusals.
  EXPECT_NE(error_of("", {{"workload", "llama-tiny"}, {"kv_heads", "3"}}).find("heads 4 is not a multiple of kv_heads (3)"),
            std::string::npos);
  EXPECT_NE(error_of("", {{"kv_heads", "2"}}).find("kv_heads 2 with architecture gpt2"), std::string::npos);
  EXPECT_NE(error_of("", {{"architecture", "rwkv"}}).find("unknown architecture 'rwkv'"), std::string::npos);
  EXPECT_NE(error_of("", {{"vocab", "100"}}).find("vocab 100 is below the data's 256 byte values"), std::string::npos);
  EXPECT_NE(error_of("", {{"workload", "fmnist-mlp"}, {"architecture", "llama"}}).find("[model] keys"), std::string::npos);
}



// What node 0 sends to the other nodes of a job: to_toml() read back gives the same job.
TEST(JobConfig, TomlTextRoundTripsEveryKey) {
  auto c = troupe::load_job_config("", {{"pipeline", "2"},
                                        {"data_parallel", "2"},
                                        {"microbatches", "4"},
                                        {"split", "4,2"},
                                        {"lr", "0.00123"},
                                        {"schedule", "gpipe"},
                                        {"metrics", "/tmp/m s.jsonl"},
                                        {"text", "/data/my text's \"best\" \\ part\tone.txt"},
                                        {"checksum", "true"},
                                        {"recompute", "full"},
                                        {"layers", "6"},
                                        {"d_model", "64"},
                                        {"seq_len", "96"}});
  const auto back = troupe::job_config_from_toml(c.to_toml(), "test");
  EXPECT_EQ(back.to_toml(), c.to_toml());
  EXPECT_EQ(back.split, (std::vector<int>{4, 2}));
  EXPECT_EQ(back.metrics, "/tmp/m s.jsonl");
  EXPECT_EQ(back.text, "/data/my text's \"best\" \\ part\tone.txt");  // quotes, backslash, tab escaped
  // Strings are TOML basic strings, as manifests of earlier checkpoints hold them (a
  // resumed run compares the texts): "gpt-tiny", not 'gpt-tiny'.
  EXPECT_NE(c.to_toml().find("workload = \"gpt-tiny\"\n"), std::string::npos) << c.to_toml();
  EXPECT_NE(c.to_toml().find("text = \"/data/my text's \\\"best\\\" \\\\ part\\tone.txt\"\n"), std::string::npos)
      << c.to_toml();
  EXPECT_DOUBLE_EQ(back.lr, 0.00123);
  EXPECT_EQ(back.model().decoder.n_layer, 6);
  EXPECT_EQ(back.model().decoder.d_model, 64);
  EXPECT_EQ(back.model().decoder.seq_len, 96);
  EXPECT_THROW(troupe::job_config_from_toml("pipeline = [", "test"), troupe::config_error);
}

// Message faults: tensor messages, or (":loss") the last stage's loss reports, or (":eval")
// its evaluation results; what cannot apply is refused up front.
TEST(JobConfig, MessageFaultsAreCheckedUpFront) {
  auto with = [](const std::string& fault) {
    return troupe::load_job_config("", {{"pipeline", "2"}, {"message", fault}});
  };
  EXPECT_NO_THROW(with("drop@0:0:3"));
  EXPECT_NO_THROW(with("duplicate@1:1:2:loss"));
  EXPECT_THROW(with("corrupt@0:1:2:loss"), troupe::config_error);  // a loss report has no checksum
  EXPECT_THROW(with("drop@0:0:2:loss"), troupe::config_error);     // stage 0 reports no loss
  EXPECT_THROW(with("drop@0:1:2:grad"), troupe::config_error);
  EXPECT_NO_THROW(with("drop@0:1:2:eval"));
  EXPECT_THROW(with("corrupt@0:1:2:eval"), troupe::config_error);
  EXPECT_THROW(with("duplicate@0:0:2:eval"), troupe::config_error);  // stage 0 scores nothing
  EXPECT_THROW(with("lose@0:1:2"), troupe::config_error);
}

// kill_node: one node:step, or several joined by '+' (one per node: a node 1 that rejoins,
// then node 0 killed later in the same launch).
TEST(JobConfig, EvalModeAndTokensAreChecked) {
  const auto c = troupe::load_job_config("", {{"eval_mode", "gather"}, {"eval_tokens", "512"}});
  EXPECT_EQ(c.eval_mode, "gather");
  EXPECT_EQ(c.eval_tokens, 512);
  EXPECT_EQ(troupe::load_job_config("", {}).eval_mode, "pipeline");
  EXPECT_THROW(troupe::load_job_config("", {{"eval_mode", "gathered"}}), troupe::config_error);
  EXPECT_THROW(troupe::load_job_config("", {{"eval_tokens", "0"}}), troupe::config_error);
}

// A job that lost hosts goes on with fewer nodes: its own layout where the node count still
// divides it, else fewer replicas of the same micro-batch size (more micro-batches each).
TEST(JobConfig, ShrinkLayoutKeepsTheMicroBatchSizeAndPrefersMoreNodes) {
  auto job = [](std::vector<std::pair<std::string, std::string>> keys) { return troupe::load_job_config("", keys); };
  using L = troupe::elastic_layout;
  auto eq = [](const L& a, const L& b) {
    return a.nodes == b.nodes && a.data_parallel == b.data_parallel && a.microbatches == b.microbatches;
  };
  // p1 d4, micro-batches of 4: 3 hosts left. 3 nodes need 3 replicas (32 samples do not
  // split into 3 x 4k), so 2 nodes, keeping all 4 replicas (2 per node).
  const auto d4 = job({{"pipeline", "1"}, {"data_parallel", "4"}, {"microbatches", "2"}});
  EXPECT_TRUE(eq(troupe::shrink_layout(d4, 3, 1), L{2, 4, 2}));
  EXPECT_TRUE(eq(troupe::shrink_layout(d4, 4, 1), L{4, 4, 2}));  // nothing lost: the job's own
  EXPECT_THROW(troupe::shrink_layout(d4, 3, 3), troupe::config_error);
  // p1 d3 of 4 micro-batches of 3 (global 36) on 2 nodes: 2 replicas of 6 micro-batches.
  const auto d3 = job({{"pipeline", "1"}, {"data_parallel", "3"}, {"microbatches", "4"}, {"global_batch", "36"}});
  EXPECT_TRUE(eq(troupe::shrink_layout(d3, 2, 1), L{2, 2, 6}));
  EXPECT_TRUE(eq(troupe::shrink_layout(d3, 1, 1), L{1, 3, 4}));
  // Hybrid sharding keeps its shard groups whole: p1 d4 of micro-batches of 2 (global 24)
  // on 3 hosts goes on as 3 replicas, with shard groups of 2 as 4 replicas on 2 nodes.
  const auto d4g = job({{"pipeline", "1"}, {"data_parallel", "4"}, {"microbatches", "3"}, {"global_batch", "24"}});
  EXPECT_TRUE(eq(troupe::shrink_layout(d4g, 3, 1), L{3, 3, 4}));
  auto grouped = d4g;
  grouped.shard_group = 2;
  EXPECT_TRUE(eq(troupe::shrink_layout(grouped, 3, 1), L{2, 4, 3}));
  // p4 d2 on 8 nodes, 7 left: 4 nodes; with 3 left only 2 (a node holds whole stages).
  const auto p4 = job({{"pipeline", "4"}, {"data_parallel", "2"}, {"microbatches", "4"}});
  EXPECT_TRUE(eq(troupe::shrink_layout(p4, 7, 2), L{4, 2, 4}));
  EXPECT_TRUE(eq(troupe::shrink_layout(p4, 3, 2), L{2, 2, 4}));
  // The shrunk layout must be a valid job: p2 d3 of 2 micro-batches of 2 on 4 nodes needs
  // d2 with 3 micro-batches, which 1f1b takes and interleaved-1f1b (a multiple of the 2
  // stages) refuses.
  auto p2d3 = [&](const char* schedule, const char* chunks) {
    return job({{"pipeline", "2"}, {"data_parallel", "3"}, {"microbatches", "2"}, {"global_batch", "12"},
                {"schedule", schedule}, {"chunks", chunks}});
  };
  EXPECT_TRUE(eq(troupe::shrink_layout(p2d3("1f1b", "1"), 4, 4), L{4, 2, 3}));
  try {
    troupe::shrink_layout(p2d3("interleaved-1f1b", "2"), 4, 4);
    ADD_FAILURE() << "an interleaved layout of 3 micro-batches on 2 stages was taken";
  } catch (const troupe::config_error& e) {
    EXPECT_NE(std::string(e.what()).find("fits 4 node(s)"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(eq(troupe::shrink_layout(p2d3("interleaved-1f1b", "2"), 4, 2), L{3, 3, 2}));
  EXPECT_THROW(troupe::shrink_layout(d4, 1, 2), troupe::config_error);  // fewer left than the minimum
  // Tensor parallelism (T2): a node holds whole groups, or an equal part of each (a group
  // spread over nodes). p1 d2: 4 nodes spread both groups; 3 left: 2 nodes of one group
  // each; p1 d1 on 2 nodes (one group spread), 1 left: the group in one node.
  const auto t2 = job({{"pipeline", "1"}, {"data_parallel", "2"}, {"microbatches", "2"}, {"tensor_parallel", "2"}});
  EXPECT_TRUE(eq(troupe::shrink_layout(t2, 4, 1), L{4, 2, 2}));
  EXPECT_TRUE(eq(troupe::shrink_layout(t2, 3, 1), L{2, 2, 2}));
  const auto t2d1 = job({{"pipeline", "1"}, {"microbatches", "2"}, {"tensor_parallel", "2"}});
  EXPECT_TRUE(eq(troupe::shrink_layout(t2d1, 2, 1), L{2, 1, 2}));
  EXPECT_TRUE(eq(troupe::shrink_layout(t2d1, 1, 1), L{1, 1, 2}));
  // T4 p1 d1: 3 nodes would hold a third of a group; 2 hold half each.
  const auto t4 = job({{"pipeline", "1"}, {"microbatches", "2"}, {"tensor_parallel", "4"}, {"heads", "4"}});
  EXPECT_TRUE(eq(troupe::shrink_layout(t4, 3, 1), L{2, 1, 2}));
  EXPECT_TRUE(troupe::nodes_fit(1, 1, 4, 4) && troupe::nodes_fit(2, 1, 2, 1) && !troupe::nodes_fit(1, 1, 4, 3) &&
              !troupe::nodes_fit(1, 3, 2, 4) && !troupe::nodes_fit(1, 1, 1, 0));
}
}  // namespace troupe
