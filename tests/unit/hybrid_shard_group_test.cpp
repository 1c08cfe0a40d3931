// transport/hybrid.hpp: shard groups of g ranks over a d-rank communicator (HSDP). The
// reduce-scatter is the sum over all d ranks in its documented order (within the shard
// group in ring order, then across the replica group in ring order), the same bits on
// every replica of a piece; the all-gather stays within the shard group.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>

#include "rank_threads.hpp"
#include "transport/hybrid.hpp"
#include "transport/local/local_group.hpp"
#include "transport/ucx/ucx_communicator.hpp"

using namespace troupe;
using namespace troupe::transport;
using test::inputs;
using test::on_threads;

namespace {

constexpr auto kWait = std::chrono::seconds(20);

std::vector<std::shared_ptr<communicator>> ucx_members(int size) {
  std::vector<std::unique_ptr<ucx_pending>> pending;
  std::vector<std::string> addresses;
  for (int r = 0; r < size; ++r) {
    pending.push_back(prepare_ucx_communicator(r, size));
    addresses.push_back(pending.back()->address());
  }
  std::vector<std::shared_ptr<communicator>> out;
  for (auto& p : pending) out.push_back(p->connect(addresses));
  return out;
}

/// Piece `s` of the sum over all d ranks, added as the hybrid communicator documents:
/// each shard group's ring-order sum of the piece, then each part of that (cut R ways)
/// summed over the R groups in ring order.
torch::Tensor hybrid_sum(const std::vector<torch::Tensor>& all, int g, int s) {
  const int d = int(all.size()), R = d / g;
  const auto [b, e] = piece(all[0].numel(), g, s);
  std::vector<torch::Tensor> partial;
  for (int k = 0; k < R; ++k) {
    std::vector<torch::Tensor> members;
    for (int i = 0; i < g; ++i) members.push_back(all[std::size_t(k * g + i)].narrow(0, b, e - b));
    partial.push_back(torch::empty({e - b}));
    ring_order_sum(partial.back(), members, s);
  }
  auto out = torch::empty({e - b});
  for (int i = 0; i < R; ++i) {
    const auto [pb, pe] = piece(e - b, R, i);
    std::vector<torch::Tensor> parts;
    for (const auto& p : partial) parts.push_back(p.narrow(0, pb, pe - pb));
    auto slot = out.narrow(0, pb, pe - pb);
    ring_order_sum(slot, parts, i);
  }
  return out;
}

void check_collectives(std::vector<std::shared_ptr<communicator>> parents, int g, std::int64_t size) {
  const int d = int(parents.size());
  std::vector<std::shared_ptr<communicator>> comms;
  for (auto& p : parents) comms.push_back(hybrid_shard_group(p, g));
  const auto all = inputs(d, size);
  const auto plain = torch::stack(all).sum(0);
  std::vector<torch::Tensor> scattered(d), gathered(d), reduced(d);
  on_threads(d, [&](int r) {
    auto& c = *comms[std::size_t(r)];
    ASSERT_EQ(c.size(), g);
    ASSERT_EQ(c.rank(), r % g);
    const auto [b, e] = piece(size, g, r % g);
    scattered[r] = torch::empty({e - b});
    c.reduce_scatter(all[r], scattered[r])->wait_or_throw(kWait);
    gathered[r] = torch::empty({size});
    c.all_gather(all[r].narrow(0, b, e - b).clone(), gathered[r])->wait_or_throw(kWait);
    reduced[r] = all[r].clone();
    c.all_reduce(reduced[r])->wait_or_throw(kWait);
  });
  for (int r = 0; r < d; ++r) {
    const int s = r % g, group = r / g;
    const auto [b, e] = piece(size, g, s);
    SCOPED_TRACE("d " + std::to_string(d) + ", g " + std::to_string(g) + ", size " + std::to_string(size) +
                 ", rank " + std::to_string(r));
    EXPECT_TRUE(torch::allclose(scattered[r], plain.narrow(0, b, e - b), 1e-5, 1e-5));
    EXPECT_TRUE(torch::equal(scattered[r], hybrid_sum(all, g, s)));  // the documented order, bit for bit
    EXPECT_TRUE(torch::equal(scattered[r], scattered[s]));           // every replica of the piece
    for (int i = 0; i < g; ++i) {  // the shard group's pieces, not another group's
      const auto [pb, pe] = piece(size, g, i);
      EXPECT_TRUE(torch::equal(gathered[r].narrow(0, pb, pe - pb), all[group * g + i].narrow(0, pb, pe - pb)));
    }
    EXPECT_TRUE(torch::allclose(reduced[r], plain, 1e-5, 1e-5));
    EXPECT_TRUE(torch::equal(reduced[r], reduced[0]));
  }
}

}  // namespace

TEST(HybridShardGroup, SumsOverEveryRankAndGathersWithinTheGroup) {
  for (const auto& [d, g] : std::vector<std::pair<int, int>>{{4, 2}, {6, 3}, {6, 2}, {4, 1}, {2, 1}})
    for (std::int64_t size : {1, 7, 1000}) check_collectives(make_local_group(d), g, size);
}

TEST(HybridShardGroup, OverUcxAsOverTheLocalGroup) { check_collectives(ucx_members(4), 2, 1001); }

TEST(HybridShardGroup, TheWholeGroupIsTheCommunicatorItselfAndOtherSizesAreRefused) {
  auto members = make_local_group(4);
  EXPECT_EQ(hybrid_shard_group(members[1], 4), members[1]);
  EXPECT_THROW(hybrid_shard_group(members[1], 3), std::invalid_argument);
  EXPECT_THROW(hybrid_shard_group(members[1], 0), std::invalid_argument);
  EXPECT_THROW(hybrid_shard_group(nullptr, 1), std::invalid_argument);
}

TEST(HybridShardGroup, AbortFailsTheRunningAndLaterCollectives) {
  auto members = make_local_group(4);
  auto c0 = hybrid_shard_group(members[0], 2);
  auto in = torch::ones({8}), out = torch::empty({4});
  auto w = c0->reduce_scatter(in, out);  // its peers never call: it waits
  EXPECT_FALSE(w->wait(std::chrono::milliseconds(100)));
  c0->abort("a peer died");
  EXPECT_THROW(w->wait(std::chrono::seconds(5)), transport_error);
  EXPECT_NE(w->error().find("a peer died"), std::string::npos) << w->error();
  auto later = c0->all_gather(torch::ones({4}), torch::empty({8}));
  EXPECT_THROW(later->wait(std::chrono::seconds(5)), transport_error);
}

TEST(HybridShardGroup, ASilentPeerTimesOut) {
  auto members = make_local_group(2);
  auto c0 = hybrid_shard_group(members[0], 1, std::chrono::milliseconds(200));
  auto t = torch::ones({4});
  auto w = c0->all_reduce(t);  // rank 1 never joins the replica group's ring
  EXPECT_THROW(w->wait(std::chrono::seconds(10)), transport_error);
}
