#include "compute/models/model_spec.hpp"

namespace troupe {

namespace {
constexpr struct {
  decoder_arch arch;
  const char* name;
} kArchs[] = {{decoder_arch::gpt2, "gpt2"},
              {decoder_arch::llama, "llama"},
              {decoder_arch::mistral, "mistral"},
              {decoder_arch::qwen2, "qwen2"},
              {decoder_arch::qwen3, "qwen3"}};
}  // namespace

decoder_arch parse_decoder_arch(const std::string& name) {
  for (const auto& a : kArchs)
    if (name == a.name) return a.arch;
  throw std::invalid_argument("unknown architecture '" + name + "' (expected gpt2, llama, mistral, qwen2 or qwen3)");
}

const char* decoder_arch_name(decoder_arch arch) {
  for (const auto& a : kArchs)
    if (arch == a.arch) return a.name;
  return "gpt2";
}

std::string model_spec::name() const {
  if (type == kind::mlp) return "fmnist-mlp";
  return decoder.arch == decoder_arch::gpt2 ? "gpt" : decoder_arch_name(decoder.arch);
}

recompute_mode parse_recompute(const std::string& name) {
  if (name == "none") return recompute_mode::none;
  if (name == "selective") return recompute_mode::selective;
  if (name == "full") return recompute_mode::full;
  throw std::invalid_argument("unknown recompute '" + name + "' (expected none, selective or full)");
}

}  // namespace troupe
