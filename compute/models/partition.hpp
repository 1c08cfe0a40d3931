#pragma once
// Splitting a model's layers over pipeline stages and virtual chunks.
#include <stdexcept>
#include <string>
#include <vector>

namespace troupe {

struct partition_error : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

/// The layers [first, last) one slice owns. `first_slice` owns the embeddings (or the
/// data input), `last_slice` the final norm, the output layer and the loss.
struct layer_range {
  int stage = 0;         ///< pipeline stage k of p
  int chunk = 0;         ///< virtual chunk c of v on that stage
  int virtual_stage = 0; ///< c * p + k: position in the whole pipeline
  int first = 0;
  int last = 0;
  bool first_slice = true;
  bool last_slice = true;
};

/// Splits `n_layers` over `stages` x `chunks` virtual stages. Virtual stage x = c * p + k
/// (chunk c of stage k, as Megatron's interleaving). Evenly by default (the first
/// n % (p v) virtual stages get one extra layer); `split` gives each virtual stage's
/// layer count explicitly. Every virtual stage needs at least one layer.
/// Result: indexed by virtual stage.
std::vector<layer_range> partition_layers(int n_layers, int stages, int chunks = 1,
                                          const std::vector<int>& split = {});

}  // namespace troupe
