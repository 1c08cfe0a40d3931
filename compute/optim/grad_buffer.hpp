#pragma once
// Shard ranges of Megatron's distributed optimizer over a slice's flat buffers.
//
//   flat buffer:  | wte ........ | wpe .... | h.0.ln_1 | h.0.attn.c_attn ...... | pad |
//   shards (d=3): |<--- rank 0 --->|<--- rank 1 --->|<--- rank 2 --->|
//
// Each data-parallel rank owns one equal range of the (padded) buffer; ranges ignore
// parameter boundaries. A `shard_piece` is where one parameter and one shard overlap.
//
// With gradient buckets (Megatron's overlapped gradient reduction) the buffer is cut into
// consecutive buckets, each reduce-scattered on its own as soon as the last backward has
// produced its gradients; each rank owns one equal piece of every bucket:
//
//   buckets:      |<------ bucket 0 ------>|<---------- bucket 1 ---------->|
//   shards (d=2): |  rank 0   |  rank 1    |    rank 0      |    rank 1      |
//
// and its shard is the concatenation of its pieces (a `shard_layout`). One bucket gives
// the equal ranges above.
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/types.h>

#include <map>

#include "compute/models/model_slice.hpp"
#include "compute/optim/optimizer.hpp"

namespace torch::autograd {
struct Node;
}

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

/// A rank's shard: ranges of the flat buffer, in order; the shard is their concatenation.
using shard_layout = std::vector<flat_range>;

/// Gradient buckets of a slice's buffer of `padded_size` elements (a multiple of `ranks`)
/// laid out as `entries`: consecutive ranges covering it, each a multiple of `ranks`
/// elements. Built from the end (the backward produces the last parameters' gradients
/// first): a bucket ends where a parameter begins once it holds at least
/// `bucket_elems` elements (rounded to a multiple of `ranks`: a boundary may fall a few
/// elements into a parameter). `bucket_elems` <= 0: one bucket, the whole buffer.
std::vector<flat_range> grad_buckets(const std::vector<param_entry>& entries, std::int64_t padded_size, int ranks,
                                     std::int64_t bucket_elems);

/// The groups a slice's buffer is reduced and sharded over (Megatron's expert-data-parallel
/// layout): its dense region [0, expert_offset) over the data-parallel group, its expert
/// region (model_slice::expert_offset; expert_share) over the expert-data-parallel group,
/// the ranks holding the same experts.
///
///   buffer:     | dense parameters ............ | pad | this rank's experts ... | pad |
///   reduced over the data-parallel group (d)     | the expert-data-parallel group (d t / EP)
struct shard_groups {
  int ranks = 1, rank = 0;  ///< the data-parallel group, this rank's place in it
  std::int64_t expert_offset = std::numeric_limits<std::int64_t>::max();  ///< none: past the end
  int expert_ranks = 1, expert_rank = 0;  ///< the expert-data-parallel group
  bool in_experts(const flat_range& r) const { return r.begin >= expert_offset; }
  int ranks_of(const flat_range& r) const { return in_experts(r) ? expert_ranks : ranks; }
  int rank_of(const flat_range& r) const { return in_experts(r) ? expert_rank : rank; }
};

/// The gradient buckets of `slice` (grad_buckets) for `g`: its dense region's over
/// g.ranks, then its expert region's over g.expert_ranks; no bucket spans both. `by_blocks`
/// (FSDP by blocks): nor a block's bounds (model_slice::entry_block).
std::vector<flat_range> slice_buckets(const model_slice& slice, const shard_groups& g, std::int64_t bucket_elems,
                                      bool by_blocks = false);

/// Rank `rank`'s shard of a buffer cut into `buckets`: its equal piece of each bucket
/// (what a reduce-scatter of that bucket over `ranks` ranks gives it), in bucket order.
shard_layout bucket_shard(const std::vector<flat_range>& buckets, int ranks, int rank);

/// The same over both regions of `g`: each bucket's piece for this rank of its group.
shard_layout bucket_shard(const std::vector<flat_range>& buckets, const shard_groups& g);

/// Elements of a shard (the sum of its ranges).
std::int64_t shard_size(const shard_layout& shard);

/// The whole buffer from its `ranks` bucket shards concatenated in rank order (what an
/// all-gather of each rank's whole shard gives): every piece put back in its bucket.
/// With one bucket, `gathered` itself.
torch::Tensor from_rank_order(const torch::Tensor& gathered, const std::vector<flat_range>& buckets, int ranks);
/// The same over both regions of `g`: `gathered` holds the dense region's shards in rank
/// order (g.ranks of them), then the expert region's (g.expert_ranks).
torch::Tensor from_rank_order(const torch::Tensor& gathered, const std::vector<flat_range>& buckets,
                              const shard_groups& g);

/// The overlap of one parameter with one shard.
struct shard_piece {
  std::size_t entry = 0;       ///< index into the slice's entries
  flat_range in_param;         ///< elements of the parameter (0-based in the parameter)
  flat_range in_shard;         ///< the same elements, 0-based in the shard
};

/// Parameter -> shard: every piece of every parameter that falls in `shard`, in shard order.
std::vector<shard_piece> shard_pieces(const std::vector<param_entry>& entries, const shard_layout& shard);

/// Shard -> parameter: the entry holding flat element `index`, or -1 for padding.
int entry_at(const std::vector<param_entry>& entries, std::int64_t index);

/// Per element of `shard`: 1 where weight decay applies, else 0 (bool tensor).
torch::Tensor decay_mask(const std::vector<param_entry>& entries, const shard_layout& shard);

/// Per element of `shard`: 1 where the element counts in the global grad norm (not
/// padding, not a shared copy of a tied parameter), else 0 (bool tensor).
torch::Tensor norm_mask(const std::vector<param_entry>& entries, const shard_layout& shard);

/// Optimizer state by parameter name, the layout-free form checkpoints use.
struct named_moments {
  std::map<std::string, torch::Tensor> exp_avg, exp_avg_sq;  ///< flat, full parameter size
  /// The fp32 main parameters (flat), where the model's own are rounded (bf16 jobs).
  std::map<std::string, torch::Tensor> main_params;
};

/// A piece of one parameter's optimizer state as a shard holds it: elements [offset,
/// offset + data.numel()) of the flat parameter, `numel` elements in all.
struct moment_piece {
  std::string name;  ///< "exp_avg.NAME", "exp_avg_sq.NAME" or "main.NAME"
  std::int64_t offset = 0, numel = 0;
  torch::Tensor data;  ///< flat, on the host, a copy
};

/// Shard `shard`'s AdamW moments by parameter piece (shared copies of tied parameters
/// are left out), and with `main_params` its main parameters too: what a shard sends for
/// a checkpoint, its own elements only.
std::vector<moment_piece> moment_pieces(const std::vector<param_entry>& entries, const shard_layout& layout,
                                        const adamw_shard& shard, bool main_params = false);

/// Puts `piece` into `out`, whose tensor for it is made at its first piece (zeros of the
/// parameter's size). The pieces of all shards of a slice assemble the whole.
void add_moment_piece(named_moments& out, const moment_piece& piece);

/// Adds shard `shard`'s pieces (moment_pieces) into `out`.
void gather_moments(const std::vector<param_entry>& entries, const shard_layout& layout, const adamw_shard& shard,
                    named_moments& out, bool main_params = false);

/// Puts the fp32 main parameters of `moments` (bf16 jobs) in place of `model`'s rounded ones
/// (every one must have them: std::logic_error names one that has not). Without main
/// parameters in `moments` (fp32 jobs) `model` stays as it is.
void use_main_params(state_dict& model, const named_moments& moments);

/// Restores shard `layout` from a checkpoint by name: main parameters from `params`,
/// moments from `optim` ("exp_avg.<name>", "exp_avg_sq.<name>"), and the step count.
/// Throws std::runtime_error naming a missing entry.
void restore_shard(const std::vector<param_entry>& entries, const shard_layout& layout, adamw_shard& shard,
                   const std::map<std::string, torch::Tensor>& params,
                   const std::map<std::string, torch::Tensor>& optim, std::int64_t steps);

/// Reports, during a slice's backward, each gradient bucket whose gradients that backward
/// has finished accumulating (Megatron's bucket hooks for its overlapped gradient
/// reduction): a hook on each parameter's gradient accumulator counts the parameters of a
/// bucket still to come. Armed for one backward (the step's last of the slice); `finish`
/// reports the buckets it did not (parameters that got no gradient, or a backward that
/// ran unarmed) and disarms. The callback runs on the thread running the backward (with
/// CUDA: LibTorch's autograd thread of the device, its current stream the one the
/// gradients were accumulated on). Each bucket is reported once per arming. The watch
/// holds the parameters' gradient accumulators; one it makes keeps the calling thread's
/// current stream and accumulates on it: make the watch where the slice computes.
class grad_ready_watch {
 public:
  using callback = std::function<void(int bucket)>;
  grad_ready_watch(model_slice& slice, std::vector<flat_range> buckets, callback cb);
  ~grad_ready_watch();
  grad_ready_watch(const grad_ready_watch&) = delete;
  grad_ready_watch& operator=(const grad_ready_watch&) = delete;

  const std::vector<flat_range>& buckets() const { return buckets_; }
  /// The buckets holding elements of parameter `param` (an index into the slice's entries).
  const std::vector<int>& buckets_holding(std::size_t param) const;
  /// The next backward reports buckets as their gradients become final.
  void arm();
  /// Reports every bucket not reported since `arm` (all of them when not armed), disarms.
  void finish();
  /// Drops the arming without reporting (an aborted step).
  void disarm();
  /// Buckets reported by hooks (not by `finish`) since the watch was made (tests).
  std::int64_t reported_early() const;

  struct state;  // shared with the hooks

 private:
  std::vector<flat_range> buckets_;
  std::shared_ptr<state> state_;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;  // kept: hooks live on them
};

}  // namespace troupe
