#pragma once
// Shard ranges of Megatron's distributed optimizer over a slice's flat buffers.
//
//   flat buffer:  | wte ........ | wpe .... | h.0.ln_1 | h.0.attn.c_attn ...... | pad |
//   shards (d=3): |<--- rank 0 --->|<--- rank 1 --->|<--- rank 2 --->|
//
// Each data-parallel rank owns one equal range of the (padded) buffer; ranges ignore
// parameter boundaries. A `shard_piece` is where one parameter and one shard overlap.
#include <cstdint>
#include <string>
#include <vector>

#include <torch/types.h>

#include <map>

#include "compute/model.hpp"
#include "compute/optimizer.hpp"

namespace troupe {

/// A half-open range [begin, end) of flat buffer elements.
struct flat_range {
  std::int64_t begin = 0;
  std::int64_t end = 0;
  std::int64_t size() const { return end - begin; }
  bool operator==(const flat_range& o) const { return begin == o.begin && end == o.end; }
};

/// Equal ranges of a buffer of `padded_size` elements (a multiple of `ranks`).
std::vector<flat_range> shard_ranges(std::int64_t padded_size, int ranks);

/// The overlap of one parameter with one shard.
struct shard_piece {
  std::size_t entry = 0;       ///< index into the slice's entries
  flat_range in_param;         ///< elements of the parameter (0-based in the parameter)
  flat_range in_shard;         ///< the same elements, 0-based in the shard
};

/// Parameter -> shard: every piece of every parameter that falls in `shard`, in order.
std::vector<shard_piece> shard_pieces(const std::vector<param_entry>& entries, const flat_range& shard);

/// Shard -> parameter: the entry holding flat element `index`, or -1 for padding.
int entry_at(const std::vector<param_entry>& entries, std::int64_t index);

/// Per element of `shard`: 1 where weight decay applies, else 0 (bool tensor).
torch::Tensor decay_mask(const std::vector<param_entry>& entries, const flat_range& shard);

/// Per element of `shard`: 1 where the element counts in the global grad norm (not
/// padding, not a shared copy of a tied parameter), else 0 (bool tensor).
torch::Tensor norm_mask(const std::vector<param_entry>& entries, const flat_range& shard);

/// Optimizer state by parameter name, the layout-free form checkpoints use.
struct named_moments {
  std::map<std::string, torch::Tensor> exp_avg, exp_avg_sq;  ///< flat, full parameter size
  /// The fp32 main parameters (flat), where the model's own are rounded (bf16 jobs).
  std::map<std::string, torch::Tensor> main_params;
};

/// Adds shard `range`'s AdamW moments into `out` (per-parameter flat CPU tensors, zero
/// outside the shard; shared copies of tied parameters are left out), and with
/// `main_params` its main parameters too. Summing the `named_moments` of all shards of a
/// slice assembles the whole.
void gather_moments(const std::vector<param_entry>& entries, const flat_range& range, const adamw_shard& shard,
                    named_moments& out, bool main_params = false);

/// Restores shard `range` from a checkpoint by name: main parameters from `params`,
/// moments from `optim` ("exp_avg.<name>", "exp_avg_sq.<name>"), and the step count.
/// Throws std::runtime_error naming a missing entry.
void restore_shard(const std::vector<param_entry>& entries, const flat_range& range, adamw_shard& shard,
                   const std::map<std::string, torch::Tensor>& params,
                   const std::map<std::string, torch::Tensor>& optim, std::int64_t steps);

}  // namespace troupe
