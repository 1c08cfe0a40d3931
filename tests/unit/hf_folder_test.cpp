// Hugging Face folders (compute/checkpoint/hf_folder.cpp): export then read back is bit-identical for
// both families, GPT-2's Conv1D layout and prefix, shards, padded vocabulary rows, a run
// started from a folder, and every bad input named. That transformers itself loads the
// folders with the same logits: tests/integration/hf_client_test.cpp.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

#include "compute/checkpoint/hf_folder.hpp"
#include "compute/checkpoint/checkpoint.hpp"
#include "compute/checkpoint/safetensors.hpp"
#include "compute/trainer/local_trainer.hpp"
#include "test_util.hpp"

namespace troupe {

namespace fs = std::filesystem;

namespace {

model_spec small(const std::string& workload) {
  auto c = test::gpt_config(1);
  c.workload = workload;
  c.layers = 2;
  c.d_model = 32;
  c.seq_len = 16;
  c.validate();
  return c.model();
}

std::string error_of(const std::string& dir, const model_spec& spec) {
  try {
    read_hf_folder(dir, spec);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

void expect_equal(const state_dict& a, const state_dict& b) {
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].first, b[i].first);
    EXPECT_TRUE(torch::equal(a[i].second, b[i].second)) << a[i].first;
  }
}

nlohmann::json config_of(const std::string& dir) {
  std::ifstream in(fs::path(dir) / "config.json");
  return nlohmann::json::parse(in);
}

void write_config(const std::string& dir, const nlohmann::json& c) {
  std::ofstream(fs::path(dir) / "config.json") << c.dump(2);
}

}  // namespace

TEST(HuggingFaceFolder, ExportThenReadIsBitIdenticalForEveryFamily) {
  for (const std::string workload : {"gpt-tiny", "llama-tiny", "moe-tiny"}) {
    test::temp_dir dir;
    const auto spec = small(workload);
    const auto state = initial_state(spec, 7);
    EXPECT_EQ(export_hf_folder(dir / "hf", spec, state), state.size());
    EXPECT_TRUE(is_hf_folder(dir / "hf"));
    expect_equal(read_hf_folder(dir / "hf", spec), state);
    // bf16: the values rounded to bf16, and torch_dtype says so.
    export_hf_folder(dir / "bf16", spec, state, {torch::kBFloat16, 0});
    EXPECT_EQ(config_of(dir / "bf16").at("torch_dtype"), "bfloat16");
    const auto back = read_hf_folder(dir / "bf16", spec);
    for (std::size_t i = 0; i < state.size(); ++i)
      EXPECT_TRUE(torch::equal(back[i].second, state[i].second.to(torch::kBFloat16).to(torch::kFloat32)))
          << workload << " " << state[i].first;
  }
}

// GPT2LMHeadModel's names and Conv1D layout; LlamaForCausalLM's names as they are; the
// config's fields whose Hugging Face defaults differ from Troupe's models.
TEST(HuggingFaceFolder, NamesLayoutAndConfigAreHuggingFaces) {
  test::temp_dir dir;
  const auto gpt = small("gpt-tiny");
  const auto state = initial_state(gpt, 7);
  export_hf_folder(dir / "gpt", gpt, state);
  const auto tensors = read_safetensors(dir / "gpt/model.safetensors");
  std::map<std::string, torch::Tensor> by_name(tensors.begin(), tensors.end());
  EXPECT_EQ(by_name.count("lm_head.weight"), 0u) << "tied: from_pretrained ties it again";
  ASSERT_EQ(by_name.count("transformer.h.1.attn.c_attn.weight"), 1u);
  const auto& c_attn = by_name.at("transformer.h.1.attn.c_attn.weight");
  EXPECT_EQ(c_attn.sizes().vec(), (std::vector<std::int64_t>{32, 96}));  // [in, out]
  for (const auto& [name, t] : state)
    if (name == "h.1.attn.c_attn.weight") EXPECT_TRUE(torch::equal(c_attn, t.t()));
  const auto g = config_of(dir / "gpt");
  EXPECT_EQ(g.at("architectures"), nlohmann::json({"GPT2LMHeadModel"}));
  EXPECT_EQ(g.at("activation_function"), "gelu");
  EXPECT_EQ(g.at("layer_norm_epsilon").get<double>(), 1e-5);
  EXPECT_EQ(g.at("n_inner"), 128);
  EXPECT_EQ(g.at("n_positions"), 16);
  const auto llama = small("llama-tiny");
  export_hf_folder(dir / "llama", llama, initial_state(llama, 7));
  const auto l = config_of(dir / "llama");
  EXPECT_EQ(l.at("architectures"), nlohmann::json({"LlamaForCausalLM"}));
  EXPECT_EQ(l.at("rms_norm_eps").get<double>(), 1e-5);
  EXPECT_EQ(l.at("num_key_value_heads"), 2);
  EXPECT_EQ(l.at("intermediate_size"), 96);
  EXPECT_EQ(l.at("tie_word_embeddings"), false);
  EXPECT_EQ(l.at("vocab_size"), 256);
  const auto names = read_safetensors(dir / "llama/model.safetensors");
  EXPECT_EQ(names.front().first, "model.embed_tokens.weight");
  EXPECT_EQ(names.back().first, "lm_head.weight");
  // Experts: a Mixtral folder (its names are the state_dict's), and a job without the
  // same experts is told what differs.
  const auto moe = small("moe-tiny");
  export_hf_folder(dir / "mixtral", moe, initial_state(moe, 7));
  const auto m = config_of(dir / "mixtral");
  EXPECT_EQ(m.at("architectures"), nlohmann::json({"MixtralForCausalLM"}));
  EXPECT_EQ(m.at("model_type"), "mixtral");
  EXPECT_EQ(m.at("num_local_experts"), 4);
  EXPECT_EQ(m.at("num_experts_per_tok"), 2);
  EXPECT_EQ(m.at("intermediate_size"), moe.decoder.expert_d_ff());
  bool gate = false;
  for (const auto& [name, t] : read_safetensors(dir / "mixtral/model.safetensors"))
    gate = gate || name == "model.layers.1.block_sparse_moe.gate.weight";
  EXPECT_TRUE(gate);
  auto other = moe;
  other.decoder.moe_top_k = 1;
  EXPECT_NE(error_of(dir / "mixtral", other).find("num_experts_per_tok 2 (the job's moe_top_k 1)"), std::string::npos)
      << error_of(dir / "mixtral", other);
  EXPECT_NE(error_of(dir / "mixtral", llama).find("holds a mixtral model"), std::string::npos)
      << error_of(dir / "mixtral", llama);
  auto every_other = moe;
  every_other.decoder.moe_every = 2;
  EXPECT_THROW(export_hf_folder(dir / "mixed", every_other, initial_state(every_other, 7)), checkpoint_error);
}

// Shards listed by model.safetensors.index.json, as save_pretrained writes large models.
TEST(HuggingFaceFolder, ReadsShardedFolders) {
  test::temp_dir dir;
  const auto spec = small("llama-tiny");
  const auto state = initial_state(spec, 7);
  export_hf_folder(dir / "one", spec, state);
  const auto tensors = read_safetensors(dir / "one/model.safetensors");
  fs::create_directories(dir / "sharded");
  fs::copy_file(dir / "one/config.json", dir / "sharded/config.json");
  named_tensors first(tensors.begin(), tensors.begin() + 5), second(tensors.begin() + 5, tensors.end());
  write_safetensors(dir / "sharded/model-00001-of-00002.safetensors", first);
  write_safetensors(dir / "sharded/model-00002-of-00002.safetensors", second);
  nlohmann::json index;
  index["metadata"] = {{"total_size", 0}};
  for (const auto& [n, t] : first) index["weight_map"][n] = "model-00001-of-00002.safetensors";
  for (const auto& [n, t] : second) index["weight_map"][n] = "model-00002-of-00002.safetensors";
  std::ofstream(dir / "sharded/model.safetensors.index.json") << index.dump();
  expect_equal(read_hf_folder(dir / "sharded", spec), state);
  // A shard the index names but that is missing: named.
  fs::remove(dir / "sharded/model-00002-of-00002.safetensors");
  EXPECT_NE(error_of(dir / "sharded", spec).find("its index names model-00002-of-00002.safetensors, which is missing"),
            std::string::npos)
      << error_of(dir / "sharded", spec);
}

// The tokenizer's vocabulary is exported; the model's padded rows are added back (zero)
// on import.
TEST(HuggingFaceFolder, PaddedVocabularyRowsAreDroppedAndAddedBack) {
  test::temp_dir dir;
  auto spec = small("llama-tiny");
  spec.decoder.vocab = 384;
  const auto state = initial_state(spec, 7);
  export_hf_folder(dir / "hf", spec, state, {torch::kFloat32, 300});
  EXPECT_EQ(config_of(dir / "hf").at("vocab_size"), 300);
  for (const auto& [name, t] : read_safetensors(dir / "hf/model.safetensors"))
    if (name == "model.embed_tokens.weight" || name == "lm_head.weight") EXPECT_EQ(t.size(0), 300) << name;
  const auto back = read_hf_folder(dir / "hf", spec);
  for (std::size_t i = 0; i < state.size(); ++i) {
    const auto& [name, t] = state[i];
    if (name == "model.embed_tokens.weight" || name == "lm_head.weight") {
      EXPECT_TRUE(torch::equal(back[i].second.narrow(0, 0, 300), t.narrow(0, 0, 300))) << name;
      EXPECT_EQ(back[i].second.narrow(0, 300, 84).abs().sum().item<double>(), 0.0) << name;
    } else {
      EXPECT_TRUE(torch::equal(back[i].second, t)) << name;
    }
  }
}

// --init DIR: a run started from a folder is the run started from the same weights in a
// state_dict file.
TEST(HuggingFaceFolder, ARunStartsFromAFolder) {
  test::temp_dir dir;
  auto c = test::gpt_config(2);
  c.workload = "llama-tiny";
  c.layers = 2;
  c.d_model = 32;
  c.seq_len = 16;
  c.runtime = "local";
  c.microbatches = 2;
  const auto spec = c.model();
  auto state = initial_state(spec, 99);
  export_hf_folder(dir / "hf", spec, state);
  save_state_dict(dir / "init.pt", state);
  auto from_folder = c, from_file = c;
  from_folder.init = dir / "hf";
  from_file.init = dir / "init.pt";
  local_trainer a(from_folder), b(from_file);
  for (int i = 0; i < 2; ++i) EXPECT_EQ(a.step().loss, b.step().loss);
  expect_equal(a.state(), b.state());
}

TEST(HuggingFaceFolder, BadFoldersAreNamed) {
  test::temp_dir dir;
  const auto spec = small("llama-tiny");
  const auto state = initial_state(spec, 7);
  const auto fresh = [&](const std::string& name) {
    export_hf_folder(dir / name, spec, state);
    return std::string(dir / name);
  };
  // Another model, another shape, another epsilon or activation: config.json names it.
  EXPECT_NE(error_of(fresh("gpt"), small("gpt-tiny")).find("holds a llama model (config.json model_type); the job's model is gpt2"),
            std::string::npos);
  auto c = config_of(fresh("kv"));
  c["num_key_value_heads"] = 4;
  c.erase("rms_norm_eps");  // LlamaConfig's default, 1e-6
  write_config(dir / "kv", c);
  const auto kv = error_of(dir / "kv", spec);
  EXPECT_NE(kv.find("num_key_value_heads 4 (the job's kv_heads 2)"), std::string::npos) << kv;
  EXPECT_NE(kv.find("rms_norm_eps 1e-06 (the job's norm_eps 1e-05)"), std::string::npos) << kv;
  const auto gpt = small("gpt-tiny");
  export_hf_folder(dir / "gelu", gpt, initial_state(gpt, 7));
  auto g = config_of(dir / "gelu");
  g.erase("activation_function");
  write_config(dir / "gelu", g);
  EXPECT_NE(error_of(dir / "gelu", gpt).find("activation_function gelu_new (Troupe's gpt2 uses the exact GELU"),
            std::string::npos);
  // A missing tensor, a wrong shape, integer values: the tensor is named.
  const auto rewrite = [&](const std::string& name, const std::function<void(named_tensors&)>& change) {
    const auto folder = fresh(name);
    auto tensors = read_safetensors(folder + "/model.safetensors");
    change(tensors);
    write_safetensors(folder + "/model.safetensors", tensors);
    return error_of(folder, spec);
  };
  const auto missing = rewrite("missing", [](named_tensors& t) { t.erase(t.begin() + 3); });
  EXPECT_NE(missing.find("missing model.layers.0.self_attn.k_proj.weight"), std::string::npos) << missing;
  const auto shape = rewrite("shape", [](named_tensors& t) { t[2].second = torch::zeros({5, 5}); });
  EXPECT_NE(shape.find("model.layers.0.self_attn.q_proj.weight has shape [5, 5], expected [32, 32]"), std::string::npos)
      << shape;
  const auto ints = rewrite("ints", [](named_tensors& t) { t[1].second = torch::ones({32}, torch::kInt64); });
  EXPECT_NE(ints.find("tensor model.layers.0.input_layernorm.weight holds Long values"), std::string::npos) << ints;
  // A truncated file, a header that does not parse, no config, no weights.
  const auto cut = fresh("cut");
  fs::resize_file(cut + "/model.safetensors", fs::file_size(cut + "/model.safetensors") - 100);
  EXPECT_NE(error_of(cut, spec).find("past the file's"), std::string::npos) << error_of(cut, spec);
  const auto garbled = fresh("garbled");
  {
    std::fstream f(garbled + "/model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(8);
    f.write("}}}}", 4);
  }
  EXPECT_NE(error_of(garbled, spec).find("does not parse as JSON"), std::string::npos) << error_of(garbled, spec);
  const auto no_config = fresh("no-config");
  fs::remove(no_config + "/config.json");
  EXPECT_NE(error_of(no_config, spec).find("has no config.json"), std::string::npos);
  const auto no_weights = fresh("no-weights");
  fs::remove(no_weights + "/model.safetensors");
  EXPECT_NE(error_of(no_weights, spec).find("has no weights"), std::string::npos);
}

}  // namespace troupe
