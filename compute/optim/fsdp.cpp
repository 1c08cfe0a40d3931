#include "compute/optim/fsdp.hpp"

#include <stdexcept>

#include <c10/core/StorageImpl.h>
#include <torch/torch.h>

#include "compute/models/model_slice.hpp"

namespace troupe {

shard_level parse_shard_level(const std::string& name) {
  if (name == "optimizer") return shard_level::optimizer;
  if (name == "gradients") return shard_level::gradients;
  if (name == "parameters") return shard_level::parameters;
  throw std::invalid_argument("shard '" + name + "': one of optimizer (ZeRO-1), gradients (ZeRO-2), parameters (ZeRO-3)");
}

const char* shard_level_name(shard_level level) {
  switch (level) {
    case shard_level::optimizer: return "optimizer";
    case shard_level::gradients: return "gradients";
    case shard_level::parameters: return "parameters";
  }
  return "?";
}

at::DataPtr storage_pool::take(std::size_t nbytes, c10::Allocator* allocator) {
  auto it = free_.lower_bound(nbytes);
  if (it == free_.end()) {
    auto ptr = allocator->allocate(nbytes);
    lent_[ptr.get()] = nbytes;
    return ptr;
  }
  auto ptr = std::move(it->second);
  lent_[ptr.get()] = it->first;
  free_.erase(it);
  return ptr;
}

void storage_pool::put(at::DataPtr ptr) {
  const auto it = lent_.find(ptr.get());
  if (it == lent_.end()) return;  // (not from this pool: freed as it goes)
  const auto capacity = it->second;
  lent_.erase(it);
  free_.emplace(capacity, std::move(ptr));
}

void storage_pool::clear() { free_.clear(); }

std::size_t storage_pool::held() const {
  std::size_t n = 0;
  for (const auto& [capacity, ptr] : free_) n += capacity;
  return n;
}

void release_storage(const torch::Tensor& t, storage_pool* pool) {
  auto* impl = t.storage().unsafeGetStorageImpl();
  if (impl->nbytes() == 0) return;
  auto old = impl->set_data_ptr(at::DataPtr(nullptr, impl->device()));
  impl->set_nbytes(0);
  if (pool) pool->put(std::move(old));
}

void materialize_storage(const torch::Tensor& t, std::size_t nbytes, storage_pool* pool) {
  auto* impl = t.storage().unsafeGetStorageImpl();
  if (impl->nbytes() != 0) return;
  impl->set_data_ptr_noswap(pool ? pool->take(nbytes, impl->allocator()) : impl->allocator()->allocate(nbytes));
  impl->set_nbytes(nbytes);
}

bool storage_held(const torch::Tensor& t) { return t.storage().unsafeGetStorageImpl()->nbytes() != 0; }

std::size_t held_bytes(const torch::Tensor& t) {
  return t.defined() ? t.storage().unsafeGetStorageImpl()->nbytes() : 0;
}

namespace {

/// The group bucket `b` of `sh` is gathered and reduced over.
collective_group& group_of(const sharded_slice& sh, std::size_t b, collective_group& group, collective_group* experts) {
  if (!sh.expert_bucket.at(b)) return group;
  if (!experts) throw std::logic_error("FSDP: an expert bucket without an expert-data-parallel group");
  return *experts;
}

}  // namespace

sharded_slice shard_slice(model_slice& slice, std::vector<flat_range> buckets, shard_layout layout, bool params,
                          storage_pool* pool, const shard_groups& groups) {
  if (buckets.size() != layout.size()) throw std::logic_error("FSDP: a piece per bucket");
  sharded_slice sh;
  sh.buckets = std::move(buckets);
  sh.layout = std::move(layout);
  for (const auto& b : sh.buckets) sh.expert_bucket.push_back(groups.in_experts(b));
  for (std::size_t b = 0; b < sh.layout.size(); ++b)
    sh.at.push_back(b == 0 ? 0 : sh.at.back() + sh.layout[b - 1].size());
  const auto size = shard_size(sh.layout);
  const auto flat = slice.flat_params();
  sh.param_bytes = flat.storage().nbytes();
  sh.grad_bytes = slice.flat_grads().storage().nbytes();
  sh.grads = torch::zeros({size}, slice.flat_grads().options());
  sh.shards_params = params;
  sh.pool = pool;
  if (params) {
    std::vector<torch::Tensor> mine;
    for (const auto& piece : sh.layout) mine.push_back(flat.narrow(0, piece.begin, piece.size()));
    sh.params = torch::cat(mine);  // (a copy: the buffer is released next)
    release_storage(flat);
  }
  release_storage(slice.flat_grads());
  return sh;
}

void start_gather(model_slice& slice, sharded_slice& sh, collective_group& group, collective_group* experts,
                  bool ahead) {
  if (!sh.shards_params) return;
  const auto flat = slice.flat_params();
  if (storage_held(flat)) return;  // (held, or its gather started)
  // Gathered through an alias of the buffer with a version counter of its own: the
  // saved views of a forward see their values again, at their versions (a refill
  // between a forward and its backward is no in-place change to autograd, as FSDP2's
  // gather into its resized storage is not).
  materialize_storage(flat, sh.param_bytes, sh.pool);
  torch::NoGradGuard no_grad;
  const auto alias = torch::from_blob(flat.data_ptr(), {flat.numel()}, flat.options());
  for (std::size_t b = 0; b < sh.buckets.size(); ++b) {
    const auto& bucket = sh.buckets[b];
    sh.gathering.push_back(group_of(sh, b, group, experts)
                               .start_all_gather(sh.params.narrow(0, sh.at[b], sh.layout[b].size()),
                                                 alias.narrow(0, bucket.begin, bucket.size()),
                                                 ahead ? "prefetched all-gather" : "all-gather"));
  }
}

void gather_params(model_slice& slice, sharded_slice& sh, collective_group& group, collective_group* experts) {
  if (!sh.shards_params) return;
  start_gather(slice, sh, group, experts);
  auto started = std::move(sh.gathering);
  sh.gathering.clear();
  for (auto& g : started) g.wait();  // (on an error, the rest are settled as `started` goes)
  if (!sh.copies_fresh) {  // (bf16 slices: their fp32 copies of the norms and embeddings)
    slice.refresh_copies();
    sh.copies_fresh = true;
  }
}

void release_params(model_slice& slice, sharded_slice& sh) {
  sh.gathering.clear();  // (none in flight writes into the buffer: settled)
  if (sh.shards_params) release_storage(slice.flat_params(), sh.pool);
}

void make_grads(model_slice& slice, const sharded_slice& sh) {
  const auto grads = slice.flat_grads();
  if (storage_held(grads)) return;
  materialize_storage(grads, sh.grad_bytes, sh.pool);
  grads.zero_();
}

void reduce_grads(model_slice& slice, sharded_slice& sh, collective_group& group, collective_group* experts,
                  const flat_range* only) {
  const auto grads = slice.flat_grads();
  if (!storage_held(grads)) return;  // (nothing accumulated since the last reduction)
  torch::NoGradGuard no_grad;
  for (std::size_t i = sh.buckets.size(); i-- > 0;) {
    const auto& bucket = sh.buckets[i];
    if (only && (bucket.end <= only->begin || bucket.begin >= only->end)) continue;
    auto piece = torch::empty({sh.layout[i].size()}, sh.grads.options());
    group_of(sh, i, group, experts).reduce_scatter(grads.narrow(0, bucket.begin, bucket.size()), piece);
    sh.grads.narrow(0, sh.at[i], sh.layout[i].size()).add_(piece);
  }
  release_storage(grads, sh.pool);
}

}  // namespace troupe
