// --document-attention (WORKLOADS.md section 6): positions that count from 0 again after
// each EOS, the block-causal mask they give, a window of documents that computes as each
// document would alone (learned positions, rotary, a sliding window), and recomputation
// that reruns each micro-batch with its own documents. (Through the layouts:
// tests/integration/document_attention_test.cpp; against transformers:
// tests/integration/tokenizer_client_test.cpp.)
#include <gtest/gtest.h>

#include <torch/torch.h>

#include "compute/data/data.hpp"
#include "compute/models/model.hpp"
#include "compute/models/model_slice.hpp"
#include "compute/models/partition.hpp"
#include "compute/models/parts/attention.hpp"
#include "test_util.hpp"

namespace troupe {

namespace {

constexpr std::int64_t kEos = 2;

/// A small decoder of `arch` (2 layers, d_model 32, 4 heads (2 key/value heads for
/// llama's), seq_len 16, 40 ids).
model_spec small_spec(decoder_arch arch, int window = 0) {
  auto s = arch == decoder_arch::gpt2 ? model_spec::gpt_tiny() : model_spec::llama_tiny();
  auto& d = s.decoder;
  d.arch = arch;
  d.n_layer = 2;
  d.d_model = 32;
  d.d_ff = 64;
  d.seq_len = 16;
  d.vocab = 40;
  d.sliding_window = window;
  return s;
}

/// Token ids of documents of `lengths` (each ending with EOS), concatenated; no other EOS.
torch::Tensor window_of(const std::vector<std::int64_t>& lengths, std::uint64_t seed) {
  torch::manual_seed(seed);
  std::vector<torch::Tensor> docs;
  for (const auto n : lengths) {
    auto d = torch::randint(3, 40, {n}, torch::kInt64);
    d[n - 1] = kEos;
    docs.push_back(d);
  }
  return torch::cat(docs);
}

}  // namespace

TEST(DocumentAttention, PositionsCountFromZeroAfterEachEos) {
  const auto ids = torch::tensor({5, 2, 7, 8, 2, 2, 9, 4, 6, 3, 3, 3, 3, 3}, torch::kInt64).view({2, 7});
  const auto p = document_positions(ids, kEos);
  EXPECT_TRUE(torch::equal(p, torch::tensor({0, 1, 0, 1, 2, 0, 0, 0, 1, 2, 3, 4, 5, 6}, torch::kInt64).view({2, 7})))
      << p;
  // The mask: query i sees key j when j <= i and both are in one document (checked
  // against the documents written out by hand).
  const auto mask = causal_attention(7, torch::kCPU).document_mask(p);
  ASSERT_EQ(mask.sizes(), (std::vector<std::int64_t>{2, 1, 7, 7}));
  const std::vector<std::vector<int>> doc = {{0, 0, 1, 1, 1, 2, 3}, {0, 0, 0, 0, 0, 0, 0}};
  for (int b = 0; b < 2; ++b)
    for (int i = 0; i < 7; ++i)
      for (int j = 0; j < 7; ++j)
        EXPECT_EQ(mask[b][0][i][j].item<bool>(), j <= i && doc[b][i] == doc[b][j]) << b << " " << i << " " << j;
  // With a sliding window of 2: also j > i - 2.
  const auto windowed = causal_attention(7, torch::kCPU, 2).document_mask(p);
  for (int i = 0; i < 7; ++i)
    for (int j = 0; j < 7; ++j)
      EXPECT_EQ(windowed[1][0][i][j].item<bool>(), j <= i && j > i - 2) << i << " " << j;
}

// Each document of a window computes what it computes alone (its positions from 0, its
// keys only): gpt2's learned table, llama's rotary embedding with grouped heads,
// mistral's sliding window.
TEST(DocumentAttention, EachDocumentOfAWindowComputesAsIfAlone) {
  for (const auto& [arch, window] :
       {std::pair{decoder_arch::gpt2, 0}, std::pair{decoder_arch::llama, 0}, std::pair{decoder_arch::mistral, 3}}) {
    const auto spec = small_spec(arch, window);
    const auto slice = make_slice(spec, partition_layers(spec.decoder.n_layer, 1)[0], initial_state(spec, 7));
    torch::NoGradGuard no_grad;
    const std::vector<std::int64_t> lengths = {5, 1, 7, 3};  // 16 tokens
    const auto ids = torch::stack({window_of(lengths, 1), window_of({16}, 2)});
    const auto out = slice->logits(slice->forward(ids, document_positions(ids, kEos)));
    std::int64_t at = 0;
    for (const auto n : lengths) {
      const auto alone = slice->logits(slice->forward(ids.narrow(0, 0, 1).narrow(1, at, n)));
      EXPECT_LE((out.narrow(0, 0, 1).narrow(1, at, n) - alone).abs().max().item<double>(), 1e-5)
          << decoder_arch_name(arch) << ": the document at " << at;
      at += n;
    }
    // A window of one document is the plain forward; without positions the documents
    // see each other.
    EXPECT_LE((out[1] - slice->logits(slice->forward(ids.narrow(0, 1, 1)))[0]).abs().max().item<double>(), 1e-5);
    EXPECT_GT((out[0] - slice->logits(slice->forward(ids.narrow(0, 0, 1)))[0]).abs().max().item<double>(), 1e-3)
        << decoder_arch_name(arch);
  }
}

// Full and selective recomputation rerun a micro-batch with its own documents, even when
// another micro-batch's forward came in between: the gradients equal the plain backward's.
TEST(DocumentAttention, RecomputationRerunsEachMicroBatchWithItsDocuments) {
  const auto spec = small_spec(decoder_arch::llama);
  const auto a = torch::stack({window_of({3, 9, 4}, 3), window_of({12, 4}, 4)});
  const auto b = torch::stack({window_of({16}, 5), window_of({1, 1, 14}, 6)});
  const auto grads = [&](recompute_mode mode) {
    auto slice = make_slice(spec, partition_layers(spec.decoder.n_layer, 1)[0], initial_state(spec, 7));
    slice->set_recompute(mode);
    slice->zero_grads();
    const auto target = [](const torch::Tensor& x) { return x.roll(-1, 1); };
    // Both forwards first, then the backwards (as a pipeline's warm-up runs them).
    auto la = slice->loss(slice->forward(a, document_positions(a, kEos)), target(a));
    auto lb = slice->loss(slice->forward(b, document_positions(b, kEos)), target(b));
    lb.backward();
    la.backward();
    return slice->flat_grads().clone();
  };
  const auto plain = grads(recompute_mode::none);
  EXPECT_GT(plain.abs().max().item<double>(), 0);
  for (const auto mode : {recompute_mode::full, recompute_mode::selective})
    EXPECT_TRUE(torch::equal(grads(mode), plain)) << int(mode);
}

TEST(DocumentAttention, PositionsOfTheWrongShapeAreRefused) {
  const auto spec = small_spec(decoder_arch::llama);
  const auto slice = make_slice(spec, partition_layers(spec.decoder.n_layer, 1)[0], initial_state(spec, 7));
  const auto ids = torch::zeros({2, 16}, torch::kInt64);
  EXPECT_THROW(slice->forward(ids, torch::zeros({2, 8}, torch::kInt64)), model_error);
}

}  // namespace troupe
