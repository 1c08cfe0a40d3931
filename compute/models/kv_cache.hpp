#pragma once
// The key/value cache of generation.
#include <cstdint>
#include <vector>

#include <torch/types.h>

namespace troupe {

/// The keys and values a decoder slice's attention has computed for the tokens it has seen
/// (generation: each new token attends to them instead of running the earlier ones again).
/// Each block's keys and values live in a buffer of the model's whole context, allocated
/// by the first call: later tokens are written after the earlier ones, nothing is copied.
struct kv_cache {
  std::vector<torch::Tensor> keys, values;  ///< per block of the slice: (batch, heads, seq_len, head dim),
                                            ///< positions 0 .. length - 1 filled
  std::int64_t length = 0;                  ///< tokens seen (the next token's position)
  void clear() { *this = kv_cache{}; }
};

}  // namespace troupe
