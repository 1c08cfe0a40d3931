#include "compute/trainer/generate.hpp"

#include <limits>
#include <stdexcept>

#include <ATen/CPUGeneratorImpl.h>

#include "compute/models/partition.hpp"
#include "compute/data/tokenizer.hpp"

namespace troupe {

void check_sampling(const sampling_options& s, const std::string& prompt) {
  if (prompt.empty()) throw std::invalid_argument("the prompt is empty (the model needs at least one byte to continue)");
  if (s.tokens < 0) throw std::invalid_argument("tokens must be 0 or more, not " + std::to_string(s.tokens));
  if (!(s.temperature >= 0) || s.temperature > 100)
    throw std::invalid_argument("temperature must be in [0, 100], not " + std::to_string(s.temperature));
  if (s.top_k < 0) throw std::invalid_argument("top_k must be 0 (all bytes) or more, not " + std::to_string(s.top_k));
}

std::string generate(const model_spec& spec, const state_dict& state, const std::string& prompt,
                     const sampling_options& s, torch::Device device, const std::function<void(char)>& on_byte,
                     const tokenizer* tok) {
  if (spec.type != model_spec::kind::decoder) throw model_error("generate needs a gpt model, not " + spec.name());
  check_sampling(s, prompt);
  check_state(spec, state);
  layer_range whole;
  whole.last = spec.n_layers();
  const auto model = make_slice(spec, whole, state, 1, device);
  torch::NoGradGuard no_grad;
  auto gen = at::detail::createCPUGenerator(s.seed);
  std::vector<std::int64_t> ids;
  if (tok)
    for (int id : tok->encode(prompt)) ids.push_back(id);
  else
    for (unsigned char c : prompt) ids.push_back(c);
  std::string out = prompt;
  std::vector<int> added;  // with a tokenizer: the pieces added, decoded together (a character may span pieces)
  std::size_t shown = 0;   // bytes of their decoded text already given to on_byte
  const std::size_t context = std::size_t(spec.decoder.seq_len);
  kv_cache cache;
  const auto tokens = [&](std::size_t from) {
    return torch::tensor(std::vector<std::int64_t>(ids.begin() + from, ids.end()), torch::kInt64)
        .view({1, -1})
        .to(device);
  };
  for (int i = 0; i < s.tokens; ++i) {
    torch::Tensor features;
    if (s.kv_cache && ids.size() <= context) {
      features = model->forward_cached(tokens(std::size_t(cache.length)), cache);
    } else {
      cache.clear();
      features = model->forward(tokens(ids.size() > context ? ids.size() - context : 0));
    }
    auto logits = model->logits(features.select(1, -1))[0].to(torch::kCPU, torch::kDouble);
    std::int64_t next;
    if (s.temperature == 0 || s.top_k == 1) {
      next = logits.argmax().item<std::int64_t>();
    } else {
      logits = logits / s.temperature;
      if (s.top_k > 0 && s.top_k < logits.size(0)) {
        const double kth = std::get<0>(logits.topk(s.top_k))[-1].item<double>();
        logits = logits.masked_fill(logits < kth, -std::numeric_limits<double>::infinity());
      }
      next = torch::multinomial(torch::softmax(logits, 0), 1, false, gen).item<std::int64_t>();
    }
    ids.push_back(next);
    if (!tok) {
      out.push_back(char(next));
      if (on_byte) on_byte(char(next));
      continue;
    }
    added.push_back(int(next));
    // A character split over byte pieces decodes as U+FFFD until its last piece comes: the
    // text is shown up to such a tail.
    const auto text = tok->decode(added);
    static const std::string replacement = "\xef\xbf\xbd";
    std::size_t stable = text.size();
    while (stable >= shown + 3 && text.compare(stable - 3, 3, replacement) == 0) stable -= 3;
    if (on_byte)
      for (std::size_t k = shown; k < stable; ++k) on_byte(text[k]);
    shown = std::max(shown, stable);
  }
  if (tok) {
    const auto text = tok->decode(added);
    if (on_byte)
      for (std::size_t k = shown; k < text.size(); ++k) on_byte(text[k]);
    out += text;
  }
  return out;
}

}  // namespace troupe
