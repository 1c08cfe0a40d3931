#pragma once
// A model's parameters as the rest of the model code sees them: the ordered state_dict,
// the rows of the parameter tables that the parts declare (name, shape, initialisation,
// weight decay, tensor-parallel split), and a parameter's place in a slice's flat buffers.
#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <torch/types.h>

namespace troupe {

/// An ordered `state_dict`: parameter name -> tensor, in the model's canonical order.
using state_dict = std::vector<std::pair<std::string, torch::Tensor>>;

/// How a parameter is split over a tensor-parallel group (compute/models/tensor_parallel_layout.hpp).
enum class tp_split {
  replicated,  ///< every rank holds all of it (norms, row-parallel biases, positions)
  rows,        ///< dim 0 (column-parallel weights and their biases, vocab-parallel rows)
  columns,     ///< dim 1 (row-parallel weights)
  qkv_rows,    ///< gpt2's c_attn: dim 0 as three blocks [q; k; v], each split in rows
};

/// A row of a model's parameter table: name, shape, how it is initialised (WORKLOADS.md
/// init), decayed or not, how tensor parallelism splits it.
struct param_spec {
  std::string name;
  std::vector<std::int64_t> shape;
  enum class init { normal, zeros, ones, uniform_fan_in } how;
  double stddev = 0;
  bool decay = false;
  tp_split split = tp_split::replicated;
};
using param_table = std::vector<param_spec>;

/// Parameters by name (a slice's: model_slice), as the parts read them.
class named_parameters {
 public:
  virtual ~named_parameters() = default;
  /// Throws model_error for a name the slice does not hold.
  virtual torch::Tensor& param(const std::string& name) = 0;
};

/// One parameter's place in a slice's flat buffers.
struct param_entry {
  std::string name;              ///< global name, e.g. "h.3.attn.c_attn.weight"
  std::vector<std::int64_t> shape;
  std::int64_t offset = 0;       ///< first element in the flat buffers
  std::int64_t numel = 0;
  bool decay = false;            ///< weight decay applies (2-D weights, not gpt2's wpe)
  tp_split split = tp_split::replicated;  ///< how tensor parallelism splits it
  bool shared_copy = false;      ///< a second copy of a tied parameter (last stage's embedding),
                                 ///< or of a parameter every tensor-parallel rank holds whole
                                 ///< (on ranks other than 0): it is not counted twice in the
                                 ///< grad norm nor saved twice
};

/// Tokens routed to each expert, per expert layer: block index -> one count per expert,
/// then the (token, choice) pairs dropped past the experts' capacity.
using expert_counts = std::map<int, std::vector<std::int64_t>>;
/// Adds `from`'s counts into `into`.
inline void add_expert_counts(expert_counts& into, const expert_counts& from) {
  for (const auto& [layer, n] : from) {
    auto& sum = into[layer];
    sum.resize(std::max(sum.size(), n.size()), 0);
    for (std::size_t e = 0; e < n.size(); ++e) sum[e] += n[e];
  }
}

}  // namespace troupe
