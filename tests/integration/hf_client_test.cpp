// The real client: transformers' from_pretrained loads the folders `troupe export`
// writes, unchanged (LlamaForCausalLM, MixtralForCausalLM, GPT2LMHeadModel), and its logits equal Troupe's
// forward within 1e-4; and the folders transformers writes of every family it has
// (tests/support/python/hf_families.py) give Troupe's `--model DIR` the same logits,
// and export back as the same family. The clients live in a virtual environment the test makes once per
// build folder (tests/support/python/hf_venv.sh, pinned versions, wheels from pip's
// cache); where Python's package registry cannot be reached, the test is skipped.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>

#include <nlohmann/json.hpp>

#include "compute/models/model.hpp"
#include "compute/checkpoint/checkpoint.hpp"
#include "compute/checkpoint/hf_folder.hpp"
#include "compute/config/job_config.hpp"
#include "compute/models/partition.hpp"
#include "actors/tp_groups.hpp"
#include "cached_forward.hpp"
#include "compute/trainer/local_trainer.hpp"
#include "test_util.hpp"
#include "build_paths.hpp"
#include "hf_python.hpp"

namespace troupe {

namespace {

/// A model whose logits are far from uniform: the initial weights, matrices scaled up.
state_dict sharp_weights(const model_spec& spec) {
  auto state = initial_state(spec, 11);
  for (auto& [name, t] : state)
    if (t.dim() == 2) t.mul_(8);
  return state;
}

void expect_transformers_agree(const job_config& c) {
  const auto spec = c.model();
  test::temp_dir dir;
  const auto state = sharp_weights(spec);
  export_hf_folder(dir / "hf", spec, state);
  layer_range whole;
  whole.last = spec.n_layers();
  const auto model = make_slice(spec, whole, state);
  const auto tokens = torch::randint(0, spec.decoder.vocab, {2, spec.decoder.seq_len}, torch::kInt64);
  torch::Tensor logits;
  {
    torch::NoGradGuard no_grad;
    logits = model->logits(model->forward(tokens));
  }
  EXPECT_GT(logits.abs().max().item<double>(), 1.0) << "logits too flat to compare";
  save_state_dict(dir / "troupe.pt", {{"tokens", tokens}, {"logits", logits}});
  const std::string cmd = hf_python() + " " + troupe::test::source_dir + "/tests/support/python/hf_check.py " + (dir / "hf") +
                          " " + (dir / "troupe.pt");
  EXPECT_EQ(std::system(cmd.c_str()), 0) << c.model_label() << ": " << cmd;
}

/// Troupe's logits of `tokens` with the weights `state` of `spec` (one slice, no graph).
torch::Tensor troupe_logits(const model_spec& spec, const state_dict& state, const torch::Tensor& tokens) {
  layer_range whole;
  whole.last = spec.n_layers();
  const auto model = make_slice(spec, whole, state);
  torch::NoGradGuard no_grad;
  return model->logits(model->forward(tokens));
}

nlohmann::json config_of(const std::string& dir) {
  std::ifstream in(std::filesystem::path(dir) / "config.json");
  return nlohmann::json::parse(in);
}

// Folders as transformers writes them (save_pretrained, after a few training steps): the
// job takes family, shape and weights from config.json alone (train.model), its forward
// gives transformers' logits within 1e-4, and its export is the same family, in the
// folder's spelling, which transformers loads with the same logits again.
void expect_folders_of_client_read_right(int major, const std::vector<std::string>& families) {
  if (hf_python(major).empty())
    GTEST_SKIP() << "no transformers " << major << " (Python's package registry unreachable): skipped";
  test::temp_dir dir;
  std::string cmd = hf_python(major) + " " + troupe::test::source_dir + "/tests/support/python/hf_families.py " + dir.path.string();
  for (const auto& f : families) cmd += " " + f;
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  for (const auto& family : families) {
    const std::string folder = dir / family;
    SCOPED_TRACE(family + " written by transformers " + std::to_string(major));
    ASSERT_TRUE(std::filesystem::exists(folder)) << family << " not written by this transformers";
    const auto ref = load_state_dict(dir / (family + ".pt"));
    const auto& tokens = ref.at(0).second;
    const auto& expected = ref.at(1).second;
    std::vector<std::pair<std::string, std::string>> keys{{"train.model", folder}};
    if (family != "gpt2") keys.emplace_back("model.seq_len", std::to_string(tokens.size(1)));  // (gpt2: n_positions)
    const auto cfg = load_job_config("", keys);
    const auto spec = cfg.model();
    const auto state = read_hf_folder(folder, spec);
    const auto logits = troupe_logits(spec, state, tokens);
    ASSERT_EQ(logits.sizes(), expected.sizes());
    EXPECT_LE((logits - expected).abs().max().item<double>(), 1e-4)
        << cfg.model_label() << ": logits up to " << expected.abs().max().item<double>();
    // Generation's key/value cache gives the same (the window, the scaled rotations and
    // the head norms over cached keys; 24 tokens in pieces).
    if (family != "gpt2") test::expect_cached_forward_equals_full(spec, state);
    // Out again: the same family in the same spelling, loaded by transformers with Troupe's logits.
    hf_export_options opts;
    opts.source = folder;
    const std::string out = dir / (family + "-export");
    export_hf_folder(out, spec, state, opts);
    const auto theirs = config_of(folder), ours = config_of(out);
    EXPECT_EQ(ours.value("model_type", ""), theirs.value("model_type", ""));
    EXPECT_EQ(ours.contains("rope_parameters"), theirs.contains("rope_parameters"));
    EXPECT_EQ(ours.contains("dtype"), theirs.contains("dtype"));
    EXPECT_TRUE(std::filesystem::exists(std::filesystem::path(out) / "generation_config.json"));
    save_state_dict(dir / (family + "-troupe.pt"), {{"tokens", tokens}, {"logits", logits}});
    for (const char* file : {"tokenizer.json", "tokenizer_config.json"})  // (llama3's folder has a tokenizer)
      EXPECT_EQ(std::filesystem::exists(std::filesystem::path(out) / file),
                std::filesystem::exists(std::filesystem::path(folder) / file))
          << file;
    const std::string check = hf_python(major) + " " + troupe::test::source_dir + "/tests/support/python/hf_check.py " + out +
                              " " + (dir / (family + "-troupe.pt")) + " " + folder;
    EXPECT_EQ(std::system(check.c_str()), 0) << check;
  }
}

}  // namespace

TEST(HuggingFaceClient, FoldersTransformers4WritesAreEveryFamilysModel) {
  expect_folders_of_client_read_right(4, {"llama3", "llama-linear", "mistral", "mixtral", "qwen2", "gpt2"});
}

// transformers 5.x: its spelling (rope_parameters, dtype, a Qwen3-MoE's num_local_experts),
// the families only it has, and its fused experts on disk.
TEST(HuggingFaceClient, FoldersTransformers5WritesAreEveryFamilysModel) {
  expect_folders_of_client_read_right(
      5, {"llama3", "llama-linear", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "gpt2", "mixtral-fused",
          "qwen3_moe-fused"});
}

namespace {

/// Family `family`'s folder as transformers writes it (hf_families.py) trained 5 steps by
/// a plain PyTorch loop over the transformers module (hf_train_reference.py), and by
/// Troupe's local loop in the layout `layout` sets, from the same folder (train.model):
/// the same losses and final parameters within 1e-5.
void expect_trains_as_transformers(const std::string& family, const std::function<void(job_config&)>& layout,
                                   int major = 4) {
  if (hf_python(major).empty())
    GTEST_SKIP() << "no transformers " << major << " (Python's package registry unreachable): skipped";
  test::temp_dir dir;
  const std::string py = hf_python(major) + " " + troupe::test::source_dir + "/tests/support/python/";
  const std::string made = py + "hf_families.py " + dir.path.string() + " " + family;
  ASSERT_EQ(std::system(made.c_str()), 0) << made;
  const std::string folder = dir / family;
  constexpr int steps = 5, total = 200;
  auto c = test::gpt_config(total);
  c.runtime = "local";
  c.hf_model = folder;
  if (family != "gpt2") c.seq_len = 24;  // (gpt2: its n_positions)
  c.take_model_from_folder();
  layout(c);
  c.validate();
  const std::string ref = py + "hf_train_reference.py " + folder + " " + dir.path.string() + " " + std::to_string(steps) +
                          " " + std::to_string(total) + " " + std::to_string(c.model().decoder.seq_len);
  ASSERT_EQ(std::system(ref.c_str()), 0) << ref;
  std::vector<double> expected;
  std::ifstream in(dir / "losses.txt");
  for (double x; in >> x;) expected.push_back(x);
  ASSERT_EQ(expected.size(), std::size_t(steps));
  std::vector<double> losses;
  local_trainer t(c, std::nullopt, in_process_groups);  // (the groups of tensor and expert parallelism)
  for (int i = 0; i < steps; ++i) losses.push_back(t.step().loss);
  const auto got = t.state();
  for (int i = 0; i < steps; ++i) EXPECT_NEAR(losses[i], expected[i], 1e-5) << c.model_label() << " step " << i;
  EXPECT_LE(test::max_abs_diff(got, read_hf_folder(dir / "final", c.model())), 1e-5) << c.model_label();
}

void tp2_pp2(job_config& c) {
  c.tensor_parallel = 2;
  c.pipeline = 2;
}

void dp2_ep2(job_config& c) {
  c.data_parallel = 2;
  c.expert_parallel = 2;
}

}  // namespace

TEST(HuggingFaceClient, Llama3TrainsAsTransformersInTensorAndPipelineParallel) { expect_trains_as_transformers("llama3", tp2_pp2); }
TEST(HuggingFaceClient, MistralTrainsAsTransformersInTensorAndPipelineParallel) {
  expect_trains_as_transformers("mistral", tp2_pp2);
}
TEST(HuggingFaceClient, Qwen2TrainsAsTransformersInTensorAndPipelineParallel) { expect_trains_as_transformers("qwen2", tp2_pp2); }
TEST(HuggingFaceClient, Gpt2TrainsAsTransformersInTensorAndPipelineParallel) { expect_trains_as_transformers("gpt2", tp2_pp2); }
TEST(HuggingFaceClient, MixtralTrainsAsTransformersInDataAndExpertParallel) { expect_trains_as_transformers("mixtral", dp2_ep2); }
TEST(HuggingFaceClient, Qwen3TrainsAsTransformers5InTensorAndPipelineParallel) {
  expect_trains_as_transformers("qwen3", tp2_pp2, 5);
}
TEST(HuggingFaceClient, Qwen3MoeTrainsAsTransformers5InDataAndExpertParallel) {
  expect_trains_as_transformers("qwen3_moe", dp2_ep2, 5);
}

TEST(HuggingFaceClient, TransformersLoadsExportedFoldersWithTheSameLogits) {
  if (hf_python().empty()) GTEST_SKIP() << "no transformers (Python's package registry unreachable): skipped";
  auto c = test::gpt_config(1);
  c.workload = "llama-tiny";  // WORKLOADS.md's shape: 2 query heads per key/value head, untied lm_head
  expect_transformers_agree(c);
  c.layers = 2;  // another: 3 per key/value head, tied, another rope_theta and epsilon
  c.heads = 6;
  c.kv_heads = 2;
  c.d_model = 48;
  c.d_ff = 100;
  c.seq_len = 40;
  c.tie_embeddings = "true";
  c.rope_theta = 500000;
  c.norm_eps = 1e-6;
  expect_transformers_agree(c);
  auto g = test::gpt_config(1);  // gpt-tiny: GPT2LMHeadModel, Conv1D weights, tied, exact GELU
  g.layers = 3;
  expect_transformers_agree(g);
  auto m = test::gpt_config(1);  // moe-tiny: MixtralForCausalLM, top-2 of 4 experts in every block
  m.workload = "moe-tiny";
  m.layers = 2;
  expect_transformers_agree(m);
}

}  // namespace troupe
