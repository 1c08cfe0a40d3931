#pragma once
// Text from a trained gpt model: the prompt's bytes, continued one sampled byte at a time
// (`troupe generate`).
#include <cstdint>
#include <functional>
#include <string>

#include "compute/models/model.hpp"

namespace troupe {

class tokenizer;

struct sampling_options {
  int tokens = 200;          ///< bytes to add to the prompt
  double temperature = 0.8;  ///< logits are divided by it; 0: always the most likely byte
  int top_k = 0;             ///< sample among the k most likely bytes only (0: all of them)
  std::uint64_t seed = 0;    ///< the sampler's random stream
  bool kv_cache = true;      ///< reuse the keys and values of earlier bytes while they fit the context
};

/// Checks the options (throws std::invalid_argument naming the bad one).
void check_sampling(const sampling_options& s, const std::string& prompt);

/// The prompt followed by `s.tokens` bytes sampled from the gpt model `state` (of shape
/// `spec`) on `device`. Each byte is sampled from the model's next-byte distribution given
/// the last `seq_len` bytes (the model's context). While the text fits the context, a
/// key/value cache makes each byte cost a forward of that one byte (`s.kv_cache`); past
/// it, the window slides, every position changes, and each byte costs a forward of the
/// whole window (the model's positions are learned, absolute ones). `on_byte` sees each
/// byte as it is chosen.
///
/// With a tokenizer (a model trained on its pieces): the prompt is encoded with it, `s.tokens`
/// pieces are sampled, and their decoded text follows the prompt (on_byte sees its bytes
/// as they become known).
std::string generate(const model_spec& spec, const state_dict& state, const std::string& prompt,
                     const sampling_options& s, torch::Device device = torch::kCPU,
                     const std::function<void(char)>& on_byte = {}, const tokenizer* tok = nullptr);

}  // namespace troupe
