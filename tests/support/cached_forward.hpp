#pragma once
// The key/value cache's check, for every decoder architecture: a forward in pieces of
// 5, 1, 1, 3, 7, 1, 6 tokens (the last ending at the context) with a cache equals the
// full forward, through the whole model and through two slices of one block each side;
// the keys stay in the buffer allocated first, of the model's key/value heads.
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "compute/models/model.hpp"

namespace troupe::test {

struct cached_forward_run {
  std::unique_ptr<model_slice> model, first, second;  ///< the whole model; its two halves
  kv_cache cache;                                     ///< the whole model's, filled to the context
  torch::Tensor ids;                                  ///< (2, seq_len)
  torch::Tensor full;                                 ///< the whole model's forward of ids
};

inline cached_forward_run expect_cached_forward_equals_full(const model_spec& spec, const state_dict& state) {
  cached_forward_run r;
  r.ids = torch::randint(0, spec.decoder.vocab, {2, spec.decoder.seq_len}, torch::kInt64);
  layer_range whole, front, back;
  whole.last = spec.n_layers();
  front.last = back.first = 1;
  front.last_slice = back.first_slice = false;
  back.last = spec.n_layers();
  r.model = make_slice(spec, whole, state);
  r.first = make_slice(spec, front, state);
  r.second = make_slice(spec, back, state);
  torch::NoGradGuard no_grad;
  r.full = r.model->forward(r.ids);
  const auto& full = r.full;
  kv_cache cache_1, cache_2;
  std::vector<torch::Tensor> pieces, split_pieces;
  std::int64_t at = 0;
  const void* buffer = nullptr;  // the first block's keys: allocated once, for the whole context
  for (std::int64_t n : {5, 1, 1, 3, 7, 1, 6}) {
    const auto x = r.ids.slice(1, at, at + n);
    pieces.push_back(r.model->forward_cached(x, r.cache));
    split_pieces.push_back(r.second->forward_cached(r.first->forward_cached(x, cache_1), cache_2));
    at += n;
    EXPECT_EQ(r.cache.length, at);
    if (!buffer) buffer = r.cache.keys[0].data_ptr();
    EXPECT_EQ(r.cache.keys[0].data_ptr(), buffer) << "the keys were copied to a new buffer at " << at;
  }
  EXPECT_EQ(at, spec.decoder.seq_len);
  EXPECT_TRUE(torch::allclose(torch::cat(pieces, 1), full, 1e-5, 1e-5))
      << (torch::cat(pieces, 1) - full).abs().max().item<double>();
  EXPECT_TRUE(torch::allclose(torch::cat(split_pieces, 1), full, 1e-5, 1e-5))
      << (torch::cat(split_pieces, 1) - full).abs().max().item<double>();
  EXPECT_EQ(r.cache.keys.size(), std::size_t(spec.n_layers()));
  EXPECT_EQ(cache_2.keys.size(), std::size_t(spec.n_layers() - 1));
  EXPECT_EQ(r.cache.keys[0].sizes(), (std::vector<std::int64_t>{2, spec.decoder.kv_heads(), spec.decoder.seq_len,
                                                                spec.decoder.head_dim()}));
  return r;
}

}  // namespace troupe::test
