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
  // (An empty buffer, a middle stage's rest by blocks: it takes nothing, not a pool's block
  // that its release would not give back.)
  if (impl->nbytes() != 0 || nbytes == 0) return;
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

std::size_t sharded_slice::unit_of(int block) const {
  for (std::size_t u = 0; u < units.size(); ++u)
    if (units[u].block == block) return u;
  return rest();
}

void sharded_slice::new_pieces(torch::Tensor pieces) {
  params = std::move(pieces);
  for (auto& u : units) u.copies_fresh = false;
}

namespace {

/// By blocks: the units of `buckets` (each in one block, or in none), the blocks' in
/// order, then the rest (always one, maybe without buckets).
std::vector<fsdp_unit> block_units(const model_slice& slice, const std::vector<flat_range>& buckets) {
  std::map<int, fsdp_unit> by_block;
  for (std::size_t b = 0; b < buckets.size(); ++b) {
    if (buckets[b].size() == 0) continue;
    const int e = entry_at(slice.entries(), buckets[b].begin);
    const int block = e < 0 ? -1 : slice.entry_block(std::size_t(e));
    auto& u = by_block[block];
    u.block = block;
    u.buckets.push_back(b);
  }
  std::vector<fsdp_unit> out;
  for (auto& [block, u] : by_block)
    if (block >= 0) out.push_back(std::move(u));
  out.push_back(std::move(by_block[-1]));
  out.back().block = -1;
  return out;
}

}  // namespace

sharded_slice shard_slice(model_slice& slice, std::vector<flat_range> buckets, shard_layout layout, bool params,
                          storage_pool* pool, const shard_groups& groups, bool by_blocks) {
  if (buckets.size() != layout.size()) throw std::logic_error("FSDP: a piece per bucket");
  sharded_slice sh;
  sh.buckets = std::move(buckets);
  sh.layout = std::move(layout);
  for (const auto& b : sh.buckets) sh.expert_bucket.push_back(groups.in_experts(b));
  for (std::size_t b = 0; b < sh.layout.size(); ++b)
    sh.at.push_back(b == 0 ? 0 : sh.at.back() + sh.layout[b - 1].size());
  const auto size = shard_size(sh.layout);
  const auto flat = slice.flat_params();
  sh.grads = torch::zeros({size}, slice.flat_grads().options());
  sh.shards_params = params;
  sh.pool = pool;
  if (params) {
    std::vector<torch::Tensor> mine;
    for (const auto& piece : sh.layout) mine.push_back(flat.narrow(0, piece.begin, piece.size()));
    sh.params = torch::cat(mine);  // (a copy: the buffers are released next)
  }
  if (by_blocks) {
    sh.units = block_units(slice, sh.buckets);
    std::vector<std::vector<std::pair<std::int64_t, std::int64_t>>> ranges;
    for (auto& u : sh.units) {
      std::int64_t at = 0;
      for (const auto b : u.buckets) {
        const auto& bucket = sh.buckets[b];
        if (!u.ranges.empty() && u.ranges.back().second == bucket.begin)
          u.ranges.back().second = bucket.end;
        else
          u.ranges.push_back({bucket.begin, bucket.end});
        u.at.push_back(at);
        at += bucket.size();
      }
      ranges.push_back(u.ranges);
    }
    auto buffers = slice.split_buffers(ranges);
    for (std::size_t i = 0; i < sh.units.size(); ++i) {
      sh.units[i].params = std::move(buffers[i].params);
      sh.units[i].grads = std::move(buffers[i].grads);
    }
    release_storage(flat);  // (the units hold the parameters now)
  } else {
    fsdp_unit u;
    u.params = flat;
    u.grads = slice.flat_grads();
    for (std::size_t b = 0; b < sh.buckets.size(); ++b) {
      u.buckets.push_back(b);
      u.at.push_back(sh.buckets[b].begin);
    }
    u.ranges.push_back({0, flat.numel()});
    sh.units.push_back(std::move(u));
  }
  for (auto& u : sh.units) {
    u.param_bytes = u.params.storage().nbytes();
    u.grad_bytes = u.grads.storage().nbytes();
    if (params) release_storage(u.params);
    release_storage(u.grads);
  }
  release_storage(slice.flat_grads());
  return sh;
}

void start_gather(sharded_slice& sh, std::size_t i, collective_group& group, collective_group* experts, bool ahead) {
  if (!sh.shards_params) return;
  auto& u = sh.units.at(i);
  if (storage_held(u.params)) return;  // (held, or its gather started)
  // Gathered through an alias of the buffer with a version counter of its own: the
  // saved views of a forward see their values again, at their versions (a refill
  // between a forward and its backward is no in-place change to autograd, as FSDP2's
  // gather into its resized storage is not).
  materialize_storage(u.params, u.param_bytes, sh.pool);
  torch::NoGradGuard no_grad;
  const auto alias = torch::from_blob(u.params.data_ptr(), {u.params.numel()}, u.params.options());
  for (std::size_t k = 0; k < u.buckets.size(); ++k) {
    const auto b = u.buckets[k];
    u.gathering.push_back(group_of(sh, b, group, experts)
                              .start_all_gather(sh.params.narrow(0, sh.at[b], sh.layout[b].size()),
                                                alias.narrow(0, u.at[k], sh.buckets[b].size()),
                                                ahead ? "prefetched all-gather" : "all-gather"));
  }
}

void gather_params(model_slice& slice, sharded_slice& sh, std::size_t i, collective_group& group,
                   collective_group* experts) {
  if (!sh.shards_params) return;
  start_gather(sh, i, group, experts);
  auto& u = sh.units[i];
  auto started = std::move(u.gathering);
  u.gathering.clear();
  for (auto& g : started) g.wait();  // (on an error, the rest are settled as `started` goes)
  if (!u.copies_fresh) {  // (bf16 slices: their fp32 copies of the norms and embeddings)
    for (const auto& [begin, end] : u.ranges) slice.refresh_copies(begin, end);
    u.copies_fresh = true;
  }
}

void release_params(sharded_slice& sh, std::size_t i) {
  auto& u = sh.units.at(i);
  u.gathering.clear();  // (none in flight writes into the buffer: settled)
  if (sh.shards_params) release_storage(u.params, sh.pool);
}

void make_grads(const sharded_slice& sh, std::size_t i) {
  const auto& u = sh.units.at(i);
  if (storage_held(u.grads)) return;
  materialize_storage(u.grads, u.grad_bytes, sh.pool);
  u.grads.zero_();
}

bool grads_held(const sharded_slice& sh, std::size_t i) { return storage_held(sh.units.at(i).grads); }

void reduce_grads(sharded_slice& sh, std::size_t i, collective_group& group, collective_group* experts,
                  const flat_range* only) {
  auto& u = sh.units.at(i);
  if (!storage_held(u.grads)) return;  // (nothing accumulated since the last reduction)
  torch::NoGradGuard no_grad;
  for (std::size_t k = u.buckets.size(); k-- > 0;) {
    const auto b = u.buckets[k];
    const auto& bucket = sh.buckets[b];
    if (only && (bucket.end <= only->begin || bucket.begin >= only->end)) continue;
    auto piece = torch::empty({sh.layout[b].size()}, sh.grads.options());
    group_of(sh, b, group, experts).reduce_scatter(u.grads.narrow(0, u.at[k], bucket.size()), piece);
    sh.grads.narrow(0, sh.at[b], sh.layout[b].size()).add_(piece);
  }
  release_storage(u.grads, sh.pool);
}

void release_params(sharded_slice& sh) {
  for (std::size_t u = 0; u < sh.units.size(); ++u) release_params(sh, u);
}

void make_grads(const sharded_slice& sh) {
  for (std::size_t u = 0; u < sh.units.size(); ++u) make_grads(sh, u);
}

void reduce_grads(sharded_slice& sh, collective_group& group, collective_group* experts, const flat_range* only) {
  for (std::size_t u = sh.units.size(); u-- > 0;) reduce_grads(sh, u, group, experts, only);
}

}  // namespace troupe
