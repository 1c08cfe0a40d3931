#include "compute/models/model_spec.hpp"

namespace troupe {

decoder_arch parse_decoder_arch(const std::string& name) {
  if (name == "gpt2") return decoder_arch::gpt2;
  if (name == "llama") return decoder_arch::llama;
  throw std::invalid_argument("unknown architecture '" + name + "' (expected gpt2 or llama)");
}

const char* decoder_arch_name(decoder_arch arch) { return arch == decoder_arch::llama ? "llama" : "gpt2"; }

recompute_mode parse_recompute(const std::string& name) {
  if (name == "none") return recompute_mode::none;
  if (name == "selective") return recompute_mode::selective;
  if (name == "full") return recompute_mode::full;
  throw std::invalid_argument("unknown recompute '" + name + "' (expected none, selective or full)");
}

}  // namespace troupe
