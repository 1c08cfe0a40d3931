#include "compute/models/partition.hpp"

#include <numeric>

namespace troupe {

std::vector<layer_range> partition_layers(int n_layers, int stages, int chunks,
                                          const std::vector<int>& split) {
  if (stages < 1 || chunks < 1)
    throw partition_error("stages and chunks must be >= 1 (got " + std::to_string(stages) +
                          " stages, " + std::to_string(chunks) + " chunks)");
  const int n_virtual = stages * chunks;
  std::vector<int> counts(n_virtual);
  if (split.empty()) {
    if (n_layers < n_virtual)
      throw partition_error("cannot split " + std::to_string(n_layers) + " layers over " +
                            std::to_string(n_virtual) + " virtual stages (" +
                            std::to_string(stages) + " stages x " + std::to_string(chunks) +
                            " chunks): each needs at least one layer");
    for (int x = 0; x < n_virtual; ++x) counts[x] = n_layers / n_virtual + (x < n_layers % n_virtual);
  } else {
    if (static_cast<int>(split.size()) != n_virtual)
      throw partition_error("explicit split has " + std::to_string(split.size()) +
                            " entries, expected one per virtual stage (" +
                            std::to_string(n_virtual) + ")");
    if (std::accumulate(split.begin(), split.end(), 0) != n_layers)
      throw partition_error("explicit split does not sum to the model's " +
                            std::to_string(n_layers) + " layers");
    for (int x = 0; x < n_virtual; ++x) {
      if (split[x] < 1) throw partition_error("explicit split: every virtual stage needs >= 1 layer");
      counts[x] = split[x];
    }
  }
  std::vector<layer_range> out(n_virtual);
  int next = 0;
  for (int x = 0; x < n_virtual; ++x) {
    auto& r = out[x];
    r.virtual_stage = x;
    r.stage = x % stages;
    r.chunk = x / stages;
    r.first = next;
    r.last = next + counts[x];
    r.first_slice = x == 0;
    r.last_slice = x == n_virtual - 1;
    next = r.last;
  }
  return out;
}

}  // namespace troupe
