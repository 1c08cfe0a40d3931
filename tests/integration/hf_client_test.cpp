// The real client: transformers' from_pretrained loads the folders `troupe export`
// writes, unchanged (LlamaForCausalLM, MixtralForCausalLM, GPT2LMHeadModel), and its logits equal Troupe's
// forward within 1e-4. The clients live in a virtual environment the test makes once per
// build folder (tests/support/python/hf_venv.sh, pinned versions, wheels from pip's
// cache); where Python's package registry cannot be reached, the test is skipped.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>

#include "compute/models/model.hpp"
#include "compute/checkpoint/checkpoint.hpp"
#include "compute/checkpoint/hf_folder.hpp"
#include "compute/config/job_config.hpp"
#include "compute/models/partition.hpp"
#include "test_util.hpp"
#include "build_paths.hpp"

namespace troupe {

namespace {

/// The venv's python, made on first use; "" where it cannot be made.
const std::string& hf_python() {
  static const std::string py = [] {
    const std::string venv = std::filesystem::path(troupe::test::troupe_binary).parent_path() / "hf-venv";
    const std::string cmd = std::string(troupe::test::source_dir) + "/tests/support/python/hf_venv.sh " + venv;
    std::string out;
    if (FILE* p = ::popen(cmd.c_str(), "r")) {
      char buf[512];
      while (std::fgets(buf, sizeof buf, p)) out += buf;
      if (::pclose(p) != 0) return std::string();
    }
    while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
    return out;
  }();
  return py;
}

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

}  // namespace

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
