// Context parallelism's attention: each comm over C ranks against the whole sequence's
// causal attention, values and gradients (compute/parallel/context_parallel.hpp).
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "rank_threads.hpp"
#include "compute/models/parts/attention.hpp"
#include "compute/parallel/context_parallel.hpp"

using namespace troupe;

namespace {

using test::on_group_ranks;

torch::Tensor leaf(const torch::Tensor& t) { return t.detach().clone().requires_grad_(true); }

struct attention_case {
  std::int64_t heads, kv_heads, window;
};

/// The whole sequence's attention (the model's core) and its gradients for a weighted sum.
struct reference {
  torch::Tensor out, dq, dk, dv;
};

/// With `positions` ((B, S) documents' positions): the model's core with their mask.
reference whole(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& w,
                std::int64_t window, const torch::Tensor& positions = {}) {
  auto ql = leaf(q), kl = leaf(k), vl = leaf(v);
  const causal_attention core(q.size(2), torch::kCPU, window);
  auto out = core(ql, kl, vl, 0, positions.defined() ? core.document_mask(positions) : torch::Tensor());
  (out * w).sum().backward();
  return {out.detach(), ql.grad(), kl.grad(), vl.grad()};
}

/// The documents' positions of B sequences of S tokens: documents of 1 to 12 tokens,
/// positions from 0 in each, cut differently in each sequence.
torch::Tensor document_positions(std::int64_t B, std::int64_t S) {
  auto p = torch::empty({B, S}, torch::kInt64);
  auto a = p.accessor<std::int64_t, 2>();
  std::mt19937 rng(7);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t t = 0, at = 0, len = 1 + rng() % 12; t < S; ++t) {
      a[b][t] = at++;
      if (at == len) at = 0, len = 1 + rng() % 12;
    }
  return p;
}

void expect_close(const torch::Tensor& got, const torch::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const double err = (got - want).abs().max().item<double>();
  EXPECT_LT(err, 2e-5) << what;
}

/// Each of C ranks of `comm`, with its tokens of q, k, v, gives its tokens of `ref`'s
/// output and gradients (for the weighted sum by w).
void expect_every_rank_follows(cp_comm comm, int C, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const torch::Tensor& w, std::int64_t window,
                               const torch::Tensor& documents, const reference& ref, const std::string& label) {
  on_group_ranks(C, [&](int r, std::shared_ptr<collective_group> g) {
    const context_parallel place{r, C, comm, g};
    auto local = [&](const torch::Tensor& t) { return cp::local_tokens(t, 2, C, r); };
    auto ql = leaf(local(q)), kl = leaf(local(k)), vl = leaf(local(v));
    auto out = cp::attention(ql, kl, vl, place, q.size(2), window, documents);
    (out * local(w)).sum().backward();
    const auto rank = label + " rank " + std::to_string(r);
    expect_close(out.detach(), local(ref.out), rank + " out");
    expect_close(ql.grad(), local(ref.dq), rank + " dq");
    expect_close(kl.grad(), local(ref.dk), rank + " dk");
    expect_close(vl.grad(), local(ref.dv), rank + " dv");
  });
}

}  // namespace

TEST(ContextParallel, LocalPositionsAreChunksIAnd2CMinus1MinusI) {
  EXPECT_TRUE(torch::equal(cp::local_positions(16, 2, 0), torch::tensor({0, 1, 2, 3, 12, 13, 14, 15}, torch::kInt64)));
  EXPECT_TRUE(torch::equal(cp::local_positions(16, 2, 1), torch::tensor({4, 5, 6, 7, 8, 9, 10, 11}, torch::kInt64)));
  EXPECT_TRUE(torch::equal(cp::local_positions(8, 4, 3), torch::tensor({3, 4}, torch::kInt64)));
  const auto x = torch::arange(16).view({1, 16});
  EXPECT_TRUE(torch::equal(cp::local_tokens(x, 1, 2, 1).squeeze(0), cp::local_positions(16, 2, 1)));
  EXPECT_THROW(cp::local_positions(12, 4, 0), std::invalid_argument);  // 12 tokens do not cut into 8 chunks
  EXPECT_THROW(parse_cp_comm("ring"), std::invalid_argument);
}

TEST(ContextParallel, LocalCoreEqualsTheModelsCausalAttention) {
  torch::manual_seed(3);
  for (const auto& c : {attention_case{4, 4, 0}, attention_case{8, 2, 0}, attention_case{4, 2, 5}}) {
    const std::int64_t B = 2, S = 24, hd = 8;
    const auto q = torch::randn({B, c.heads, S, hd}), k = torch::randn({B, c.kv_heads, S, hd}),
               v = torch::randn({B, c.kv_heads, S, hd}), w = torch::randn({B, c.heads, S, hd});
    const auto ref = whole(q, k, v, w, c.window);
    auto ql = leaf(q), kl = leaf(k), vl = leaf(v);
    const auto all = torch::arange(S);
    auto out = cp::local_attention(ql, kl, vl, all, all, c.window);
    (out * w).sum().backward();
    const auto label = "heads " + std::to_string(c.heads) + "/" + std::to_string(c.kv_heads) + " window " +
                       std::to_string(c.window);
    expect_close(out.detach(), ref.out, label + " out");
    expect_close(ql.grad(), ref.dq, label + " dq");
    expect_close(kl.grad(), ref.dk, label + " dk");
    expect_close(vl.grad(), ref.dv, label + " dv");
  }
}

TEST(ContextParallel, EveryCommMatchesTheWholeSequenceValuesAndGradients) {
  torch::manual_seed(5);
  const std::int64_t B = 2, S = 32, hd = 8;
  for (const auto comm : {cp_comm::p2p, cp_comm::a2a, cp_comm::allgather})
    for (int C : {2, 4})
      for (const auto& c : {attention_case{8, 8, 0}, attention_case{8, 4, 0}, attention_case{8, 2, 0},
                            attention_case{4, 4, 6}}) {
        if (comm == cp_comm::a2a && c.heads % C != 0) continue;
        const auto q = torch::randn({B, c.heads, S, hd}), k = torch::randn({B, c.kv_heads, S, hd}),
                   v = torch::randn({B, c.kv_heads, S, hd}), w = torch::randn({B, c.heads, S, hd});
        const auto ref = whole(q, k, v, w, c.window);
        const auto label = std::string(cp_comm_name(comm)) + " C " + std::to_string(C) + " heads " +
                           std::to_string(c.heads) + "/" + std::to_string(c.kv_heads) + " window " +
                           std::to_string(c.window);
        expect_every_rank_follows(comm, C, q, k, v, w, c.window, {}, ref, label);
      }
}

// Documents (Megatron's reset attention mask): a token sees only the earlier tokens of its
// own document. Every comm's core, given the tokens' document numbers in the whole
// sequence, equals the model's core with the documents' mask, values and gradients.
TEST(ContextParallel, EveryCommMasksByDocumentAsTheWholeSequenceDoes) {
  torch::manual_seed(9);
  const std::int64_t B = 2, S = 48, hd = 8;
  const auto positions = document_positions(B, S);
  const auto numbers = cp::document_numbers(positions);
  EXPECT_GT(numbers.max().item<std::int64_t>(), 4);  // several documents in each sequence
  for (const auto& c : {attention_case{8, 4, 0}, attention_case{4, 4, 7}}) {
    const auto q = torch::randn({B, c.heads, S, hd}), k = torch::randn({B, c.kv_heads, S, hd}),
               v = torch::randn({B, c.kv_heads, S, hd}), w = torch::randn({B, c.heads, S, hd});
    const auto ref = whole(q, k, v, w, c.window, positions);
    ASSERT_GT((ref.out - whole(q, k, v, w, c.window).out).abs().max().item<double>(), 1e-2);  // the mask matters
    const auto case_label = "heads " + std::to_string(c.heads) + "/" + std::to_string(c.kv_heads) + " window " +
                            std::to_string(c.window);
    {
      auto ql = leaf(q), kl = leaf(k), vl = leaf(v);
      const auto all = torch::arange(S);
      auto out = cp::local_attention(ql, kl, vl, all, all, c.window, numbers);
      (out * w).sum().backward();
      expect_close(out.detach(), ref.out, "local " + case_label + " out");
      expect_close(kl.grad(), ref.dk, "local " + case_label + " dk");
    }
    for (const auto comm : {cp_comm::p2p, cp_comm::a2a, cp_comm::allgather})
      for (int C : {2, 4}) {
        const auto label = std::string(cp_comm_name(comm)) + " C " + std::to_string(C) + " " + case_label;
        expect_every_rank_follows(comm, C, q, k, v, w, c.window, numbers, ref, label);
      }
  }
}

TEST(ContextParallel, BadLayoutsAreRefused) {
  on_group_ranks(4, [](int r, std::shared_ptr<collective_group> g) {
    const auto q = torch::randn({1, 6, 4, 8}), k = torch::randn({1, 3, 4, 8});
    // 6 query heads do not split over 4 ranks (a2a trades heads for sequence)
    EXPECT_THROW(cp::attention(q, k, k, {r, 4, cp_comm::a2a, g}, 16), std::invalid_argument);
    // 4 tokens per rank are not 1/4 of 32
    EXPECT_THROW(cp::attention(q, k, k, {r, 4, cp_comm::p2p, g}, 32), std::invalid_argument);
  });
}
