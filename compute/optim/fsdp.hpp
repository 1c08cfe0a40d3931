#pragma once
// Fully sharded data parallelism (ZeRO-2 and ZeRO-3, torch's FSDP) over a slice's flat
// buffers, by units (fsdp_unit): the whole slice (a stage's chunk), or each of its blocks
// and the rest. The buffers are cut into the gradient buckets of the distributed
// optimizer (grad_buffer.hpp) and each rank owns its piece of every bucket, the same
// pieces its optimizer shard updates.
//
//   parameters (ZeRO-3): between uses a unit's parameter buffer holds no memory; it is
//   all-gathered from the ranks' pieces before it is used and released after (the saved
//   activations keep views of it: a later gather refills the same storage, as FSDP2
//   resizes its storage to 0 and back).
//   gradients (ZeRO-2) and parameters: a unit's gradient buffer exists from a backward
//   (or weight pass) that makes it to its reduction: its gradients are reduce-scattered
//   bucket by bucket, added into this rank's fp32 shard, and the buffer is released.
//   (The caller says when: actors/stage/ops.cpp.)
//
// A group of ranks calls these in one order (each a collective of the slice's group).
#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include <c10/core/Allocator.h>
#include <torch/types.h>

#include "compute/optim/grad_buffer.hpp"
#include "compute/parallel/collective_group.hpp"

namespace troupe {

/// How much of a replica's model state is sharded over its data-parallel group
/// (parallel.shard).
enum class shard_level {
  optimizer,   ///< ZeRO-1: the main parameters and moments (Megatron's distributed optimizer)
  gradients,   ///< ZeRO-2: and the gradients, reduce-scattered as each backward produces them
  parameters,  ///< ZeRO-3: and the parameters, all-gathered for each op and released after it
};
/// "optimizer", "gradients" or "parameters"; std::invalid_argument names the choices.
shard_level parse_shard_level(const std::string& name);
const char* shard_level_name(shard_level level);

/// Memory that released buffers give back and made ones take, within a step: on the
/// CPU a buffer of tens of MB freed goes back to the system, and every op would fault in
/// fresh pages (GPUs have their caching allocator). `clear` frees what it holds (at a
/// step's end: between steps the buffers hold nothing). A take is served by the smallest
/// block that fits, so chunks of different sizes share blocks. Not thread-safe: one
/// stage's thread.
class storage_pool {
 public:
  at::DataPtr take(std::size_t nbytes, c10::Allocator* allocator);
  void put(at::DataPtr ptr);
  void clear();
  std::size_t held() const;  ///< bytes of the blocks it holds

 private:
  std::multimap<std::size_t, at::DataPtr> free_;  // capacity -> block
  std::map<const void*, std::size_t> lent_;       // block -> capacity
};

/// Releases the memory of `t`'s storage: every view of it (parameters, saved tensors)
/// then points at no bytes until `materialize`. No-op when already released. With a
/// pool the memory goes there.
void release_storage(const torch::Tensor& t, storage_pool* pool = nullptr);
/// Gives `t`'s storage `nbytes` of fresh (uninitialised) memory where it holds none
/// (from `pool` when given). No-op for 0 bytes.
void materialize_storage(const torch::Tensor& t, std::size_t nbytes, storage_pool* pool = nullptr);
/// Whether `t`'s storage holds its bytes.
bool storage_held(const torch::Tensor& t);

/// A unit of FSDP: a group of a slice's gradient buckets whose parameters are gathered and
/// released together, and whose gradients are made and reduced together. By chunks the
/// slice is one unit (its flat buffers); by blocks each transformer block is one (its
/// dense buckets and, with experts over expert-parallel ranks, its expert buckets) with
/// buffers of its own (model_slice::split_buffers), and the rest of the slice (the
/// embeddings, the final norm and the output layer) another.
struct fsdp_unit {
  int block = -1;                     ///< its block; -1: the rest of the slice (by chunks: all of it)
  std::vector<std::size_t> buckets;   ///< its buckets (indices of sharded_slice::buckets), in order
  std::vector<std::int64_t> at;       ///< where each of them begins in `params` and `grads`
  std::vector<std::pair<std::int64_t, std::int64_t>> ranges;  ///< the flat buffers' ranges it holds
  torch::Tensor params, grads;        ///< its buffers (by chunks: the slice's flat buffers)
  std::size_t param_bytes = 0, grad_bytes = 0;  ///< their sizes when held
  /// bf16 slices: whether their fp32 copies of its norms and embeddings hold the pieces'
  /// values (new pieces: not until its next gather, before any graph saves them).
  bool copies_fresh = true;
  /// Parameters: the gathers started ahead of the op that needs them (start_gather), one
  /// per bucket; gather_params waits for them.
  std::vector<started_collective> gathering;
};

/// One rank's part of a slice under FSDP.
struct sharded_slice {
  std::vector<flat_range> buckets;  ///< the slice's gradient buckets (every rank's the same)
  shard_layout layout;              ///< this rank's piece of each bucket
  std::vector<std::int64_t> at;     ///< where each piece begins in the shard
  torch::Tensor params;  ///< parameters: this rank's pieces, concatenated (the parameter dtype)
  torch::Tensor grads;   ///< this rank's pieces of the step's summed gradients so far (fp32)
  /// Per bucket: whether it is in the expert region (expert parallelism), gathered and
  /// reduced over the expert-data-parallel group instead of the data-parallel one.
  std::vector<char> expert_bucket;
  bool shards_params = false;
  storage_pool* pool = nullptr;  ///< where its buffers' memory goes between ops (null: freed)
  std::vector<fsdp_unit> units;  ///< by blocks: the blocks' in order, then the rest; by chunks: one
  std::int64_t size() const { return grads.numel(); }
  std::size_t rest() const { return units.size() - 1; }  ///< the unit of the slice's other parameters
  /// The unit of block `block` (rest() where the slice has no such block).
  std::size_t unit_of(int block) const;
  /// New pieces of the parameters came (bf16: every unit's fp32 copies are stale).
  void new_pieces(torch::Tensor pieces);
};

/// Lays `slice` out for FSDP over `buckets` with this rank's pieces `layout`; with
/// `params` keeps this rank's pieces of its parameters and releases the parameter
/// buffers. The gradient buffers are released either way (zeroed when next made).
/// `pool`: where the buffers' memory goes between ops (it must outlive the result).
/// `groups`: which buckets are in the expert region (`layout` is their pieces too).
/// `by_blocks`: a unit per block (the buckets must not cross a block's bounds:
/// slice_buckets by blocks), else one unit, the slice.
sharded_slice shard_slice(model_slice& slice, std::vector<flat_range> buckets, shard_layout layout, bool params,
                          storage_pool* pool = nullptr, const shard_groups& groups = {}, bool by_blocks = false);

/// Parameters: all-gathers unit `u`'s parameter buffer from the ranks' pieces (no-op when
/// it is held), over `group`; the expert region's buckets over `experts` (its
/// expert-data-parallel group; required where the slice has them). A gather begun by
/// start_gather is waited for.
void gather_params(model_slice& slice, sharded_slice& sh, std::size_t u, collective_group& group,
                   collective_group* experts = nullptr);
/// Parameters: starts gather_params's all-gathers and returns (`ahead`, a prefetch: they go
/// on while the caller computes another op, and the group's observers call them
/// "prefetched all-gather"; the buffer holds memory from now). No-op when the buffer is
/// held or its gather started.
void start_gather(sharded_slice& sh, std::size_t u, collective_group& group, collective_group* experts = nullptr,
                  bool ahead = false);
/// Parameters: releases unit `u`'s parameter buffer.
void release_params(sharded_slice& sh, std::size_t u);
/// Makes unit `u`'s gradient buffer (zeroed) where it is released: before a backward or a
/// weight pass.
void make_grads(const sharded_slice& sh, std::size_t u);
/// Whether unit `u`'s gradient buffer is held (made since its last reduction).
bool grads_held(const sharded_slice& sh, std::size_t u);
/// Reduce-scatters unit `u`'s gradient buffer over `group` (the expert region's buckets
/// over `experts`), bucket by bucket (the last first), adds this rank's pieces into
/// `sh.grads`, and releases the buffer. With `only`: just the buckets that overlap it
/// (every rank passes the same range). No-op where the buffer is not held.
void reduce_grads(sharded_slice& sh, std::size_t u, collective_group& group, collective_group* experts = nullptr,
                  const flat_range* only = nullptr);

/// The same for every unit of the slice (reduce_grads: the last unit first).
void release_params(sharded_slice& sh);
void make_grads(const sharded_slice& sh);
void reduce_grads(sharded_slice& sh, collective_group& group, collective_group* experts = nullptr,
                  const flat_range* only = nullptr);

/// The bytes a tensor's storage holds now (0 where released).
std::size_t held_bytes(const torch::Tensor& t);

}  // namespace troupe
