#pragma once
// Fully sharded data parallelism (ZeRO-2 and ZeRO-3, torch's FSDP) over a slice's flat
// buffers. A unit is a slice (a stage's chunk: a group of layers); its buffers are cut
// into the gradient buckets of the distributed optimizer (grad_buffer.hpp) and each rank
// owns its piece of every bucket, the same pieces its optimizer shard updates.
//
//   parameters (ZeRO-3): between uses the slice's parameter buffer holds no memory; the
//   first forward or backward of a run of ops on it all-gathers it from the ranks'
//   pieces, and it is released when the run ends (the saved activations keep views of
//   it: a later gather refills the same storage, as FSDP2 resizes its storage to 0 and
//   back).
//   gradients (ZeRO-2) and parameters: the gradient buffer exists from a run's first
//   backward (or weight pass) to the run's end; its gradients are then reduce-scattered
//   bucket by bucket, added into this rank's fp32 shard, and the buffer is released.
//   (The caller says where a run ends: actors/stage/ops.cpp, when the stage's next op is
//   on another chunk.)
//
// A group of ranks calls these in one order (each a collective of the slice's group).
#include <cstdint>
#include <map>
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
/// (from `pool` when given).
void materialize_storage(const torch::Tensor& t, std::size_t nbytes, storage_pool* pool = nullptr);
/// Whether `t`'s storage holds its bytes.
bool storage_held(const torch::Tensor& t);

/// One rank's part of a slice under FSDP.
struct sharded_slice {
  std::vector<flat_range> buckets;  ///< the slice's gradient buckets (every rank's the same)
  shard_layout layout;              ///< this rank's piece of each bucket
  std::vector<std::int64_t> at;     ///< where each piece begins in the shard
  torch::Tensor params;  ///< parameters: this rank's pieces, concatenated (the parameter dtype)
  torch::Tensor grads;   ///< this rank's pieces of the step's summed gradients so far (fp32)
  std::size_t param_bytes = 0, grad_bytes = 0;  ///< the whole buffers' sizes
  /// Per bucket: whether it is in the expert region (expert parallelism), gathered and
  /// reduced over the expert-data-parallel group instead of the data-parallel one.
  std::vector<char> expert_bucket;
  bool shards_params = false;
  storage_pool* pool = nullptr;  ///< where its buffers' memory goes between ops (null: freed)
  /// bf16 slices: whether their fp32 copies of the norms and embeddings hold `params`'
  /// values (new pieces: not until the step's first gather, before any graph saves them).
  bool copies_fresh = true;
  /// Parameters: the gathers started ahead of the op that needs them (start_gather), one
  /// per bucket; gather_params waits for them.
  std::vector<started_collective> gathering;
  std::int64_t size() const { return grads.numel(); }
};

/// Lays `slice` out for FSDP over `buckets` with this rank's pieces `layout`; with
/// `params` keeps this rank's pieces of its parameters and releases the parameter
/// buffer. The gradient buffer is released either way (zeroed when it is next made).
/// `pool`: where the buffers' memory goes between ops (it must outlive the result).
/// `groups`: which buckets are in the expert region (`layout` is their pieces too).
sharded_slice shard_slice(model_slice& slice, std::vector<flat_range> buckets, shard_layout layout, bool params,
                          storage_pool* pool = nullptr, const shard_groups& groups = {});

/// Parameters: all-gathers `slice`'s parameter buffer from the ranks' pieces (no-op when
/// it is held), over `group`; the expert region's buckets over `experts` (its
/// expert-data-parallel group; required where the slice has them). A gather begun by
/// start_gather is waited for.
void gather_params(model_slice& slice, sharded_slice& sh, collective_group& group,
                   collective_group* experts = nullptr);
/// Parameters: starts gather_params's all-gathers and returns (`ahead`, a prefetch: they go
/// on while the caller computes another op, and the group's observers call them
/// "prefetched all-gather"; the buffer holds memory from now). No-op when the buffer is
/// held or its gather started.
void start_gather(model_slice& slice, sharded_slice& sh, collective_group& group, collective_group* experts = nullptr,
                  bool ahead = false);
/// Parameters: releases the parameter buffer.
void release_params(model_slice& slice, sharded_slice& sh);
/// Makes the gradient buffer (zeroed) where it is released: before a backward or a weight pass.
void make_grads(model_slice& slice, const sharded_slice& sh);
/// Reduce-scatters the gradient buffer over `group` (the expert region's buckets over
/// `experts`), bucket by bucket (the last first), adds this rank's pieces into
/// `sh.grads`, and releases the buffer. With `only`: just the buckets that overlap it
/// (every rank passes the same range).
void reduce_grads(model_slice& slice, sharded_slice& sh, collective_group& group, collective_group* experts = nullptr,
                  const flat_range* only = nullptr);

/// The bytes a tensor's storage holds now (0 where released).
std::size_t held_bytes(const torch::Tensor& t);

}  // namespace troupe
