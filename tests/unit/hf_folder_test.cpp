// Hugging Face folders (compute/checkpoint/hf_folder.cpp): export then read back is bit-identical for
// both families, GPT-2's Conv1D layout and prefix, shards, padded vocabulary rows, a run
// started from a folder, and every bad input named. That transformers itself loads the
// folders with the same logits: tests/integration/hf_client_test.cpp.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <iterator>

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

/// The families of Hugging Face folders as Troupe's models: name -> spec (llama-tiny's
/// small shape changed as each family differs).
std::vector<std::pair<std::string, model_spec>> every_family() {
  std::vector<std::pair<std::string, model_spec>> out{
      {"gpt-tiny", small("gpt-tiny")}, {"llama-tiny", small("llama-tiny")}, {"moe-tiny", small("moe-tiny")}};
  auto with = [&](const std::string& name, const std::string& workload, const std::function<void(decoder_config&)>& change) {
    auto spec = small(workload);
    change(spec.decoder);
    out.emplace_back(name, spec);
  };
  with("gpt2-gelu-new", "gpt-tiny", [](decoder_config& g) { g.gelu_tanh = true; });
  with("llama3", "llama-tiny", [](decoder_config& g) {
    g.rope = {rope_scaling::kind::llama3, 8, 1, 4, 16};
    g.rope_theta = 5e5;
  });
  with("mistral", "llama-tiny", [](decoder_config& g) {
    g.arch = decoder_arch::mistral;
    g.sliding_window = 7;
  });
  with("qwen2", "llama-tiny", [](decoder_config& g) { g.arch = decoder_arch::qwen2; });
  with("qwen3", "llama-tiny", [](decoder_config& g) {
    g.arch = decoder_arch::qwen3;
    g.head_size = 16;
  });
  with("qwen3_moe", "moe-tiny", [](decoder_config& g) {
    g.arch = decoder_arch::qwen3;
    g.head_size = 16;
    g.moe_norm_topk = false;
    g.moe_dense = {1};
  });
  return out;
}

// Every family's folder reads back bit for bit, as the same family (model_type) and
// shape (config.json alone), in fp32 and bf16.
TEST(HuggingFaceFolder, ExportThenReadIsBitIdenticalForEveryFamily) {
  for (const auto& [workload, spec] : every_family()) {
    test::temp_dir dir;
    SCOPED_TRACE(workload);
    const auto state = initial_state(spec, 7);
    EXPECT_EQ(export_hf_folder(dir / "hf", spec, state), state.size());
    EXPECT_TRUE(is_hf_folder(dir / "hf"));
    expect_equal(read_hf_folder(dir / "hf", spec), state);
    const auto shape = read_hf_model_shape(dir / "hf");
    auto g = shape.decoder;
    g.seq_len = spec.decoder.seq_len;
    EXPECT_EQ(g.arch == decoder_arch::gpt2, spec.decoder.arch == decoder_arch::gpt2);
    model_spec read_back;
    read_back.decoder = g;
    EXPECT_EQ(parameter_names(read_back), parameter_names(spec));
    EXPECT_EQ(g.head_dim(), spec.decoder.head_dim());
    EXPECT_EQ(g.gelu_tanh, spec.decoder.gelu_tanh);
    EXPECT_TRUE(g.rope == spec.decoder.rope);
    EXPECT_EQ(g.moe_norm_topk, spec.decoder.moe_norm_topk);
    for (int i = 0; i < g.n_layer; ++i) EXPECT_EQ(g.is_moe_block(i), spec.decoder.is_moe_block(i)) << i;
    if (spec.decoder.arch == decoder_arch::mistral) EXPECT_EQ(g.sliding_window, 7);
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
  // A job's own SentencePiece model goes along as tokenizer.model, byte for byte.
  std::ofstream(dir / "spm.model") << "sentencepiece model bytes";
  hf_export_options with_tokenizer;
  with_tokenizer.tokenizer = dir / "spm.model";
  export_hf_folder(dir / "llama", llama, initial_state(llama, 7), with_tokenizer);
  std::ifstream copied(dir / "llama/tokenizer.model");
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(copied), {}), "sentencepiece model bytes");
  EXPECT_TRUE(fs::exists(dir / "llama/generation_config.json"));
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
  EXPECT_NE(error_of(dir / "gelu", gpt).find("activation_function gelu_new (the job's GELU is the exact one, gelu)"),
            std::string::npos)
      << error_of(dir / "gelu", gpt);
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

// Both spellings of the rotary embedding (transformers 4.x: rope_theta, rope_scaling;
// 5.x: rope_parameters), and every field that changes the computation without Troupe
// having it: a folder whose positions or attention differ is refused by name, never read
// with the defaults (a Mixtral's rope_parameters.rope_theta 1e6 once loaded as 10000).
TEST(HuggingFaceFolder, RotaryEmbeddingAndOtherMathAreReadInBothSpellings) {
  test::temp_dir dir;
  for (const std::string workload : {"llama-tiny", "moe-tiny"}) {
    const auto spec = small(workload);
    const auto folder = std::string(dir / workload);
    export_hf_folder(folder, spec, initial_state(spec, 7));
    const auto exported = config_of(folder);
    const auto with = [&](const std::function<void(nlohmann::json&)>& change) {
      auto c = exported;
      change(c);
      write_config(folder, c);
      return error_of(folder, spec);
    };
    const auto at = [&](const std::string& e) { return workload + ": " + e; };
    // 5.x: the base inside rope_parameters, the top-level key gone.
    auto e = with([](nlohmann::json& c) {
      c.erase("rope_theta");
      c.erase("rope_scaling");
      c["rope_parameters"] = {{"rope_theta", 10000.0}, {"rope_type", "default"}};
    });
    EXPECT_EQ(e, "(no error)") << at(e);
    e = with([](nlohmann::json& c) {
      c.erase("rope_theta");
      c["rope_parameters"] = {{"rope_theta", 1e6}, {"rope_type", "default"}};
    });
    EXPECT_NE(e.find("rope_theta 1e+06 (the job's rope_theta 10000)"), std::string::npos) << at(e);
    e = with([](nlohmann::json& c) { c["rope_theta"] = 5e5; });
    EXPECT_NE(e.find("rope_theta 500000 (the job's rope_theta 10000)"), std::string::npos) << at(e);
    // Llama 3.1's scaling, in 5.x's spelling and in 4.x's: another model than the job's
    // unscaled one; incomplete, or of a kind Troupe lacks, it is named.
    e = with([](nlohmann::json& c) {
      c["rope_parameters"] = {{"rope_theta", 10000.0}, {"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0},
                              {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 8192}};
    });
    EXPECT_NE(e.find("the rotary scaling (rope_scaling / rope_parameters) differs from the job's (llama3, factor 8, "
                     "low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings 8192 against none)"),
              std::string::npos)
        << at(e);
    e = with([](nlohmann::json& c) { c["rope_parameters"] = {{"rope_theta", 10000.0}, {"rope_type", "llama3"}, {"factor", 8.0}}; });
    EXPECT_NE(e.find("rope_parameters rope_type llama3 without low_freq_factor"), std::string::npos) << at(e);
    e = with([](nlohmann::json& c) { c["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}}; });
    EXPECT_NE(e.find("(linear, factor 2 against none)"), std::string::npos) << at(e);
    e = with([](nlohmann::json& c) { c["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 2.0}}; });
    EXPECT_NE(e.find("rope_scaling rope_type yarn (Troupe's rotary embedding is the default one, linear or llama3)"),
              std::string::npos)
        << at(e);
    e = with([](nlohmann::json& c) { c["rope_scaling"] = {{"rope_type", "default"}}; });
    EXPECT_EQ(e, "(no error)") << at(e);
    e = with([](nlohmann::json& c) { c["partial_rotary_factor"] = 0.5; });
    EXPECT_NE(e.find("partial_rotary_factor 0.5 (Troupe rotates every dimension)"), std::string::npos) << at(e);
    // A sliding window shorter than the sequence; one at least as long is plain attention.
    e = with([&](nlohmann::json& c) { c["sliding_window"] = spec.decoder.seq_len / 2; });
    EXPECT_NE(e.find("sliding_window 8 (shorter than the job's seq_len 16"), std::string::npos) << at(e);
    e = with([&](nlohmann::json& c) { c["sliding_window"] = spec.decoder.seq_len; });
    EXPECT_EQ(e, "(no error)") << at(e);
    e = with([&](nlohmann::json& c) {
      c["sliding_window"] = 4;
      c["use_sliding_window"] = false;
    });
    EXPECT_EQ(e, "(no error)") << at(e);
    e = with([](nlohmann::json& c) {
      c["attn_logit_softcapping"] = 50.0;
      c["attention_dropout"] = 0.1;
      c["router_jitter_noise"] = 0.0;  // zero: no noise, as Troupe
    });
    EXPECT_NE(e.find("attn_logit_softcapping 50.0 (Troupe's"), std::string::npos) << at(e);
    EXPECT_NE(e.find("attention_dropout 0.1"), std::string::npos) << at(e);
    EXPECT_EQ(e.find("router_jitter_noise"), std::string::npos) << at(e);
  }
}

std::string config_error_of(const std::vector<std::pair<std::string, std::string>>& settings) {
  try {
    load_job_config("", settings);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

// train.model (--model DIR): the folder's config.json gives the family and the shape, no
// [model] key needed; its weights are the initial ones; set keys must agree; a seq_len
// above the folder's positions, a family Troupe lacks and 5.x's spelling are read right.
TEST(HuggingFaceFolder, TheModelComesFromTheFolder) {
  test::temp_dir dir;
  const auto llama = small("llama-tiny");  // 2 layers, d_model 32, 4 heads over 2, seq_len 16
  const auto weights = initial_state(llama, 5);
  export_hf_folder(dir / "llama", llama, weights);
  const std::string folder = dir / "llama";
  auto cfg = load_job_config("", {{"train.model", folder}, {"model.seq_len", "16"}, {"train.runtime", "local"},
                                  {"parallel.microbatches", "2"}, {"train.steps", "2"}});
  const auto got = cfg.model().decoder;
  EXPECT_TRUE(cfg.model().is_llama());
  EXPECT_EQ(got.n_layer, 2);
  EXPECT_EQ(got.d_model, 32);
  EXPECT_EQ(got.n_head, llama.decoder.n_head);
  EXPECT_EQ(got.kv_heads(), llama.decoder.kv_heads());
  EXPECT_EQ(got.d_ff, llama.decoder.d_ff);
  EXPECT_EQ(got.vocab, llama.decoder.vocab);
  EXPECT_EQ(got.tie_embeddings, false);
  EXPECT_EQ(got.norm_eps, llama.decoder.norm_eps);
  EXPECT_EQ(cfg.initial_weights(), folder);
  {
    local_trainer t(cfg);
    expect_equal(t.state(), weights);
  }
  // Keys that agree are fine; one that does not is named with the folder's value.
  EXPECT_EQ(config_error_of({{"train.model", folder}, {"model.seq_len", "16"}, {"model.layers", "2"}}), "(no error)");
  auto e = config_error_of({{"train.model", folder}, {"model.seq_len", "16"}, {"model.layers", "3"},
                            {"model.architecture", "gpt2"}});
  EXPECT_NE(e.find("model.layers 3 (config.json's num_hidden_layers 2)"), std::string::npos) << e;
  EXPECT_NE(e.find("model.architecture gpt2 (config.json's model_type llama)"), std::string::npos) << e;
  // The job's default seq_len (128) is above the exported model's positions (16).
  e = config_error_of({{"train.model", folder}});
  EXPECT_NE(e.find("model.seq_len 128 is above the folder's max_position_embeddings 16"), std::string::npos) << e;
  // The workload's own sequence (llama-small's 1024), not the folder's: a rotary
  // config.json gives none.
  e = config_error_of({{"train.model", folder}, {"train.workload", "llama-small"}});
  EXPECT_NE(e.find("model.seq_len 1024 is above the folder's max_position_embeddings 16"), std::string::npos) << e;
  // transformers 5.x's spelling: the base inside rope_parameters is the model's.
  auto c = config_of(folder);
  c.erase("rope_theta");
  c.erase("rope_scaling");
  c["rope_parameters"] = {{"rope_theta", 500000.0}, {"rope_type", "default"}};
  write_config(folder, c);
  EXPECT_EQ(load_job_config("", {{"train.model", folder}, {"model.seq_len", "16"}}).model().decoder.rope_theta, 500000.0);
  c["rope_parameters"]["rope_type"] = "llama3";
  write_config(folder, c);
  e = config_error_of({{"train.model", folder}, {"model.seq_len", "16"}});
  EXPECT_NE(e.find("rope_parameters rope_type llama3"), std::string::npos) << e;
  c["model_type"] = "gemma";
  write_config(folder, c);
  e = config_error_of({{"train.model", folder}, {"model.seq_len", "16"}});
  EXPECT_NE(e.find("model_type 'gemma' is not a family Troupe reads (llama, mistral, mixtral, qwen2, qwen3, qwen3_moe, gpt2)"),
            std::string::npos)
      << e;
  e = config_error_of({{"train.model", dir / "nothing-here"}});
  EXPECT_NE(e.find("train.model = '" + std::string(dir / "nothing-here") + "': Hugging Face folder"), std::string::npos)
      << e;
  // Mistral: Llama's blocks; a sliding window as long as the sequence is plain attention, a
  // shorter one is refused (to --model and to reading alike).
  c = config_of(folder);
  c["model_type"] = "mistral";
  c["rope_parameters"]["rope_type"] = "default";
  c["sliding_window"] = 16;
  write_config(folder, c);
  const auto mistral = load_job_config("", {{"train.model", folder}, {"model.seq_len", "16"}});
  EXPECT_TRUE(mistral.model().is_llama());
  expect_equal(read_hf_folder(folder, mistral.model()), weights);
  c["sliding_window"] = 8;
  write_config(folder, c);
  e = error_of(folder, mistral.model());
  EXPECT_NE(e.find("sliding_window 8 (shorter than the job's seq_len 16"), std::string::npos) << e;
  // Mixtral: the experts come along; gpt2: its positions are the sequence.
  const auto moe = small("moe-tiny");
  export_hf_folder(dir / "moe", moe, initial_state(moe, 5));
  const auto m = load_job_config("", {{"train.model", dir / "moe"}, {"model.seq_len", "16"}}).model().decoder;
  EXPECT_EQ(m.n_experts, moe.decoder.n_experts);
  EXPECT_EQ(m.moe_top_k, moe.decoder.moe_top_k);
  EXPECT_EQ(m.expert_d_ff(), moe.decoder.expert_d_ff());
  EXPECT_EQ(m.moe_every, 1);
  const auto gpt = small("gpt-tiny");
  export_hf_folder(dir / "gpt", gpt, initial_state(gpt, 5));
  const auto g = load_job_config("", {{"train.model", dir / "gpt"}}).model();
  EXPECT_FALSE(g.is_llama());
  EXPECT_EQ(g.decoder.seq_len, 16);
  EXPECT_EQ(g.decoder.d_model, 32);
  EXPECT_TRUE(g.decoder.tie_embeddings);
  e = config_error_of({{"train.model", dir / "gpt"}, {"train.workload", "fmnist-mlp"}});
  EXPECT_NE(e.find("a Hugging Face model is a decoder"), std::string::npos) << e;
}

}  // namespace troupe
