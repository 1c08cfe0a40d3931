#include "compute/models/parts/attention.hpp"

#include <cmath>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

#include <torch/torch.h>
#include <torch/version.h>

#include "compute/models/parts/norm.hpp"
#include "compute/parallel/context_parallel.hpp"
#include "compute/parallel/tensor_parallel.hpp"

namespace troupe {

param_table attention_params(const decoder_family& f, const decoder_config& c, const std::string& block) {
  const std::string p = block + f.attention.prefix;
  const std::int64_t d = c.d_model, q = std::int64_t(c.n_head) * c.head_dim(),
                     kv = std::int64_t(c.kv_heads()) * c.head_dim();
  const double proj_std = 0.02 / std::sqrt(2.0 * c.n_layer);
  using I = param_spec::init;
  using S = tp_split;
  const bool bias = f.attention.qkv_bias;
  param_table out;
  if (f.attention.fused_qkv) {
    out.push_back({p + f.attention.qkv + ".weight", {q + 2 * kv, d}, I::normal, 0.02, true, S::qkv_rows});
    if (bias) out.push_back({p + f.attention.qkv + ".bias", {q + 2 * kv}, I::zeros, 0, false, S::qkv_rows});
  } else {
    for (const auto& [name, rows] : {std::pair{f.attention.q, q}, std::pair{f.attention.k, kv}, std::pair{f.attention.v, kv}}) {
      out.push_back({p + name + ".weight", {rows, d}, I::normal, 0.02, true, S::rows});
      if (bias) out.push_back({p + name + ".bias", {rows}, I::zeros, 0, false, S::rows});
    }
  }
  // (Qwen3's q_norm and k_norm come between the projections and the output in its
  // modules' order.)
  for (const auto& norm : {f.attention.q_norm, f.attention.k_norm})
    if (!norm.empty()) out.push_back({p + norm + ".weight", {c.head_dim()}, I::ones});
  out.push_back({p + f.attention.out + ".weight", {d, q}, I::normal, proj_std, true, S::columns});
  if (f.attention.out_bias) out.push_back({p + f.attention.out + ".bias", {d}, I::zeros});
  return out;
}

causal_attention::causal_attention(std::int64_t seq_len, torch::Device device, std::int64_t window)
    : causal_(torch::ones({seq_len, seq_len}, torch::TensorOptions().dtype(torch::kBool).device(device)).tril()),
      windowed_(window > 0 && window < seq_len) {
  if (windowed_) causal_ = causal_.triu(-(window - 1));  // key j of query i: i - window < j <= i
}

torch::Tensor causal_attention::document_mask(const torch::Tensor& positions) const {
  const auto T = positions.size(1);
  // Documents numbered in each sequence: key j and query i share one when as many
  // documents begin at or before each.
  const auto doc = cp::document_numbers(positions);
  const auto same = doc.unsqueeze(2).eq(doc.unsqueeze(1));  // (B, T, T): [b, i, j]
  return same.logical_and(causal_.slice(0, 0, T).slice(1, 0, T).to(same.device())).unsqueeze(1);
}

torch::Tensor causal_attention::operator()(const torch::Tensor& q, torch::Tensor k, torch::Tensor v,
                                           std::int64_t past, const torch::Tensor& documents) const {
  const auto T = q.size(2), hd = q.size(3);
  if (k.size(1) != q.size(1)) {  // grouped-query: query head h uses key/value head h / (H / KV)
    const auto group = q.size(1) / k.size(1);
    k = k.repeat_interleave(group, /*dim=*/1);
    v = v.repeat_interleave(group, /*dim=*/1);
  }
  // Query t (position past + t) sees keys 0 .. past + t: rows past.. of the causal mask.
  // One new token sees them all: no mask.
  // (A sliding window masks the earlier keys of a single new token too.)
  // (Documents: their mask, the window's included, for a window without a cache.)
  const bool masked = T > 1 || windowed_ || documents.defined();
  const auto mask = documents.defined() ? documents : causal_.slice(0, past, past + T).slice(1, 0, past + T);
#if TORCH_VERSION_MAJOR >= 2
  // LibTorch 2.x: the fused kernel (flash / memory-efficient attention on GPUs).
  (void)hd;
  return past == 0 && !windowed_ && !documents.defined()
             ? at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true)
         : masked  ? at::scaled_dot_product_attention(q, k, v, mask)
                   : at::scaled_dot_product_attention(q, k, v);
#else
  auto att = torch::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(double(hd)));
  if (masked) att = att.masked_fill(mask.logical_not(), -std::numeric_limits<float>::infinity());
  att = torch::softmax(att, /*dim=*/-1);
  return torch::matmul(att, v);
#endif
}

namespace {

/// Appends k and v (B, KV, T, hd) to entry j of the cache and returns all its keys and
/// values so far. `past`: the tokens the cache holds.
std::pair<torch::Tensor, torch::Tensor> cached(kv_cache& cache, std::size_t j, std::int64_t past,
                                               std::int64_t seq_len, const torch::Tensor& k, const torch::Tensor& v) {
  const auto B = k.size(0), KV = k.size(1), T = k.size(2), hd = k.size(3);
  auto& keys = cache.keys[j];
  auto& values = cache.values[j];
  if (past == 0) {  // (a cache that starts again keeps its buffers when they fit)
    const std::vector<std::int64_t> shape{B, KV, seq_len, hd};
    if (!keys.defined() || keys.sizes() != c10::IntArrayRef(shape) || keys.scalar_type() != k.scalar_type() ||
        keys.device() != k.device()) {
      keys = torch::empty(shape, k.options());
      values = torch::empty(shape, v.options());
    }
  }
  keys.narrow(2, past, T).copy_(k);
  values.narrow(2, past, T).copy_(v);
  return {keys.narrow(2, 0, past + T), values.narrow(2, 0, past + T)};
}

/// The core for q (B, H, T, hd), k and v (B, KV, T, hd), with or without a cache; returns
/// (B, T, H * hd).
torch::Tensor attend(const decoder_config& cfg, torch::Tensor q, torch::Tensor k, torch::Tensor v, kv_cache* cache,
                     int cache_index, const attention_core& core) {
  std::int64_t past = 0;
  if (cache) {
    past = cache->length;
    std::tie(k, v) = cached(*cache, std::size_t(cache_index), past, cfg.seq_len, k, v);
  }
  auto y = core(q, k, v, past);
  const auto B = q.size(0), T = q.size(2);
  return y.transpose(1, 2).contiguous().view({B, T, q.size(1) * q.size(3)});
}

}  // namespace

torch::Tensor attention(const part_context& c, const torch::Tensor& x, const std::string& block, kv_cache* cache,
                        int cache_index, const attention_core& core, const rotary_embedding* rotary,
                        const torch::Tensor& positions) {
  const auto& o = c.family.attention;
  const std::string p = block + o.prefix;
  const std::int64_t H = c.heads, KV = c.kv_heads, hd = c.cfg.head_dim();
  const std::int64_t from = cache ? cache->length : 0;
  const auto a = c.enter(x);
  const auto B = a.size(0), T = a.size(1);
  auto heads = [&](const torch::Tensor& t, std::int64_t n) { return t.view({B, T, n, hd}).transpose(1, 2); };
  // Qwen3's per-head norm (its weight, shared by the heads, is every tensor-parallel
  // rank's whole: each rank's gradient, of its own heads, is summed over the group: f on
  // the weight; under sequence parallelism the slice's sum of the replicated ones does it).
  auto head_norm = [&](const torch::Tensor& t, const std::string& name) {
    if (name.empty()) return t;
    auto w = c.param(p + name + ".weight");
    if (c.tp.active() && !c.slice_sequence()) w = tp::copy_to(w, c.group());
    return rms_norm(t, w, c.cfg.norm_eps);
  };
  auto positioned = [&](const torch::Tensor& t, const std::string& norm) {
    const auto normed = head_norm(t, norm);
    return rotary ? rotary->rotate(normed, from, positions) : normed;
  };
  // Fewer key/value heads than tensor-parallel ranks: each rank's copy of the whole k and
  // v projections (replicated), of which it computes the head its query heads use; f on
  // the weights sums the copies' gradients over the group (under sequence parallelism the
  // slice's sum of the replicated ones does).
  const bool replicated_kv = c.tp.active() && c.cfg.kv_heads() < c.tp.size;
  auto kv_projection = [&](const std::string& name) {
    if (!replicated_kv) return c.linear(a, p + name, o.qkv_bias);
    const std::int64_t head = c.tp.rank / (c.tp.size / c.cfg.kv_heads());
    auto rank_part = [&](torch::Tensor t) {
      if (!c.slice_sequence()) t = tp::copy_to(t, c.group());
      return t.narrow(0, head * hd, hd);
    };
    return torch::linear(a, rank_part(c.param(p + name + ".weight")),
                         o.qkv_bias ? rank_part(c.param(p + name + ".bias")) : torch::Tensor());
  };
  torch::Tensor q, k, v;
  if (o.fused_qkv) {
    auto qkv = c.linear(a, p + o.qkv, o.qkv_bias).split_with_sizes({H * hd, KV * hd, KV * hd}, /*dim=*/2);
    q = positioned(heads(qkv[0], H), o.q_norm);
    k = positioned(heads(qkv[1], KV), o.k_norm);
    v = heads(qkv[2], KV);
  } else {
    q = positioned(heads(c.linear(a, p + o.q, o.qkv_bias), H), o.q_norm);
    k = positioned(heads(kv_projection(o.k), KV), o.k_norm);
    v = heads(kv_projection(o.v), KV);
  }
  return c.row_parallel(attend(c.cfg, q, k, v, cache, cache_index, core), p + o.out, o.out_bias);
}

}  // namespace troupe
