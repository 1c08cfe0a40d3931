#pragma once
// Hugging Face model folders in and out: `config.json` (a LlamaConfig or GPT2Config) and
// `model.safetensors`, as `save_pretrained` writes them and `from_pretrained` reads them.
//
// llama keeps Troupe's names (they are LlamaForCausalLM's). gpt2 takes
// GPT2LMHeadModel's: a `transformer.` prefix, and the Conv1D layout [in, out] for the
// weights of c_attn, attn.c_proj, c_fc and mlp.c_proj (Troupe's are [out, in], as
// nn.Linear's). A tied output layer is not written (from_pretrained ties it again).
// Reading takes one file, or shards listed by `model.safetensors.index.json`, or a
// `pytorch_model.bin` (torch.save's format), and checks config.json against the job's
// model: a folder of another model is refused, naming what differs.
#include <string>

#include <nlohmann/json.hpp>
#include <torch/types.h>

#include "compute/models/model.hpp"

namespace troupe {

struct hf_export_options {
  torch::ScalarType dtype = torch::kFloat32;  ///< of the written tensors (and config.json's torch_dtype)
  std::int64_t vocab = 0;  ///< embedding rows written (0: the tokenizer's pieces, vocab_used, or the model's vocab)
  /// The Hugging Face folder the model came from (train.model; "": none): config.json is
  /// written in its spelling (transformers 4.x's rope_theta and torch_dtype, or 5.x's
  /// rope_parameters and dtype) with its special tokens' ids, and its
  /// generation_config.json and tokenizer files are copied.
  std::string source;
  /// A SentencePiece model the job trained on (data.tokenizer; "": none), written as
  /// tokenizer.model.
  std::string tokenizer;
};

/// config.json's fields for `spec` (every one whose Hugging Face default differs from
/// Troupe's model is written).
nlohmann::ordered_json hf_config(const model_spec& spec, const hf_export_options& opts = {});

/// Writes `state` (Troupe's names, the full model) into folder `dir` (made if missing):
/// config.json, generation_config.json and model.safetensors, each atomically, and the
/// source folder's tokenizer files. Returns the tensors written.
std::size_t export_hf_folder(const std::string& dir, const model_spec& spec, const state_dict& state,
                             const hf_export_options& opts = {});

/// Whether `dir` is a Hugging Face model folder (a config.json, and no Troupe checkpoint).
bool is_hf_folder(const std::string& dir);

/// The weights of Hugging Face folder `dir` in Troupe's names and layout, fp32, checked
/// against `spec` (config.json, then every tensor's presence and shape). Throws
/// checkpoint_error naming the folder and what is wrong.
state_dict read_hf_folder(const std::string& dir, const model_spec& spec);

/// The model a Hugging Face folder's config.json describes, as Troupe's decoder.
struct hf_model_shape {
  std::string model_type;  ///< config.json's: llama, mistral, mixtral, qwen2, qwen3, qwen3_moe or gpt2
  decoder_config decoder;  ///< its seq_len: gpt2's n_positions, llama's the default
  int max_positions = 0;   ///< max_position_embeddings (gpt2: n_positions); 0: not given
};
/// Reads config.json of folder `dir` (transformers 4.x's and 5.x's spellings). Throws
/// checkpoint_error naming the folder and every field it cannot take: a model_type of
/// another family (hf_families()), a missing shape field, anything that changes the
/// computation and that Troupe's blocks lack (an unknown rope_type, softcapping, a shared
/// expert, biases Llama lacks, a sliding window on a family without one).
hf_model_shape read_hf_model_shape(const std::string& dir);

/// The model_types Troupe reads, for messages: "llama, mistral, mixtral, qwen2, qwen3, qwen3_moe, gpt2".
const char* hf_families();

/// Initial weights from `path`: a Hugging Face folder, or a state_dict file.
state_dict read_initial_weights(const std::string& path, const model_spec& spec);

}  // namespace troupe
