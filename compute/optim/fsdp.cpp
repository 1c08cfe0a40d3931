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

void release_storage(const torch::Tensor& t) {
  auto* impl = t.storage().unsafeGetStorageImpl();
  if (impl->nbytes() == 0) return;
  impl->set_data_ptr_noswap(at::DataPtr(nullptr, impl->device()));
  impl->set_nbytes(0);
}

void materialize_storage(const torch::Tensor& t, std::size_t nbytes) {
  auto* impl = t.storage().unsafeGetStorageImpl();
  if (impl->nbytes() != 0) return;
  impl->set_data_ptr_noswap(impl->allocator()->allocate(nbytes));
  impl->set_nbytes(nbytes);
}

void adopt_storage(const torch::Tensor& t, torch::Tensor from) {
  auto* impl = t.storage().unsafeGetStorageImpl();
  auto* src = from.storage().unsafeGetStorageImpl();
  if (impl->nbytes() != 0 || src->nbytes() == 0 || src->device() != impl->device())
    throw std::logic_error("FSDP: a storage refilled while it holds memory, or from one without");
  const auto n = src->nbytes();
  auto ptr = src->set_data_ptr(at::DataPtr(nullptr, src->device()));
  src->set_nbytes(0);
  impl->set_data_ptr_noswap(std::move(ptr));
  impl->set_nbytes(n);
}

bool storage_held(const torch::Tensor& t) { return t.storage().unsafeGetStorageImpl()->nbytes() != 0; }

std::size_t held_bytes(const torch::Tensor& t) {
  return t.defined() ? t.storage().unsafeGetStorageImpl()->nbytes() : 0;
}

sharded_slice shard_slice(model_slice& slice, std::vector<flat_range> buckets, shard_layout layout, bool params) {
  if (buckets.size() != layout.size()) throw std::logic_error("FSDP: a piece per bucket");
  sharded_slice sh;
  sh.buckets = std::move(buckets);
  sh.layout = std::move(layout);
  for (std::size_t b = 0; b < sh.layout.size(); ++b)
    sh.at.push_back(b == 0 ? 0 : sh.at.back() + sh.layout[b - 1].size());
  const auto size = shard_size(sh.layout);
  const auto flat = slice.flat_params();
  sh.param_bytes = flat.storage().nbytes();
  sh.grad_bytes = slice.flat_grads().storage().nbytes();
  sh.grads = torch::zeros({size}, slice.flat_grads().options());
  sh.shards_params = params;
  if (params) {
    std::vector<torch::Tensor> mine;
    for (const auto& piece : sh.layout) mine.push_back(flat.narrow(0, piece.begin, piece.size()));
    sh.params = torch::cat(mine);  // (a copy: the buffer is released next)
    release_storage(flat);
  }
  release_storage(slice.flat_grads());
  return sh;
}

void gather_params(model_slice& slice, sharded_slice& sh, collective_group& group) {
  if (!sh.shards_params) return;
  const auto flat = slice.flat_params();
  if (storage_held(flat)) return;
  // Gathered into memory of its own, which the buffer's storage then takes: the saved
  // views of a forward see their values again, at their versions.
  torch::NoGradGuard no_grad;
  auto whole = torch::empty({std::int64_t(sh.param_bytes / flat.element_size())}, flat.options());
  for (std::size_t b = 0; b < sh.buckets.size(); ++b) {
    const auto& bucket = sh.buckets[b];
    group.all_gather(sh.params.narrow(0, sh.at[b], sh.layout[b].size()), whole.narrow(0, bucket.begin, bucket.size()));
  }
  adopt_storage(flat, std::move(whole));
  if (!sh.copies_fresh) {  // (bf16 slices: their fp32 copies of the norms and embeddings)
    slice.refresh_copies();
    sh.copies_fresh = true;
  }
}

void release_params(model_slice& slice, const sharded_slice& sh) {
  if (sh.shards_params) release_storage(slice.flat_params());
}

void make_grads(model_slice& slice, const sharded_slice& sh) {
  const auto grads = slice.flat_grads();
  if (storage_held(grads)) return;
  materialize_storage(grads, sh.grad_bytes);
  grads.zero_();
}

void reduce_grads(model_slice& slice, sharded_slice& sh, collective_group& group) {
  const auto grads = slice.flat_grads();
  if (!storage_held(grads)) return;  // (nothing accumulated since the last reduction)
  torch::NoGradGuard no_grad;
  for (std::size_t i = sh.buckets.size(); i-- > 0;) {
    const auto& bucket = sh.buckets[i];
    auto piece = torch::empty({sh.layout[i].size()}, sh.grads.options());
    group.reduce_scatter(grads.narrow(0, bucket.begin, bucket.size()), piece);
    sh.grads.narrow(0, sh.at[i], sh.layout[i].size()).add_(piece);
  }
  release_storage(grads);
}

}  // namespace troupe
