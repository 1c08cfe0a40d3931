// transport/ordered_p2p: point-to-point matched by tag over links that deliver in order
// (NCCL's send/recv on a GPU; here links over one tag of an in-process group, which
// match strictly in order too, so a receive posted out of seq order gets wrong bytes).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <chrono>

#include "compute/runtime/device.hpp"
#include "transport/local/local_group.hpp"
#include "transport/nccl/nccl_communicator.hpp"
#include "transport/ordered_p2p.hpp"

using namespace troupe::transport;
using namespace std::chrono_literals;

namespace {

/// A link that counts what it carries.
class counting_link final : public ordered_link {
 public:
  explicit counting_link(std::shared_ptr<ordered_link> l) : l_(std::move(l)) {}
  std::string backend() const override { return "counting " + l_->backend(); }
  work_ptr send(torch::Tensor t) override {
    ++sends;
    return l_->send(std::move(t));
  }
  std::shared_ptr<link_fence> fence(const torch::Tensor& t) override { return l_->fence(t); }
  work_ptr recv(torch::Tensor t, std::shared_ptr<link_fence> f) override {
    ++recvs;
    return l_->recv(std::move(t), std::move(f));
  }
  void abort(const std::string& why) override { l_->abort(why); }
  std::atomic<int> sends{0}, recvs{0};

 private:
  std::shared_ptr<ordered_link> l_;
};

/// Two ranks: inner communicators, and links from rank 0 to rank 1 (counted) over one tag
/// of another in-process group.
struct pair {
  std::vector<std::shared_ptr<communicator>> inner = make_local_group(2), links = make_local_group(2);
  std::shared_ptr<counting_link> out = std::make_shared<counting_link>(tag_link(links[0], 1, 99));
  std::shared_ptr<counting_link> in = std::make_shared<counting_link>(tag_link(links[1], 0, 99));
  std::shared_ptr<communicator> sender = ordered_p2p(inner[0], {nullptr, out}, {});
  std::shared_ptr<communicator> receiver = ordered_p2p(inner[1], {}, {in, nullptr});
};

constexpr std::int64_t big = 8192;  // floats: 32 KiB, above the inline limit

}  // namespace

TEST(OrderedP2p, ReceivesByTagInAnyOrderOverAnInOrderLink) {
  pair p;
  std::vector<torch::Tensor> sent;
  std::vector<work_ptr> sends;
  for (std::uint32_t tag = 0; tag < 6; ++tag) {
    sent.push_back(torch::full({big}, float(tag + 1)));
    sends.push_back(p.sender->send(sent.back(), 1, 100 + tag));
  }
  auto small = torch::arange(16, torch::kFloat32);  // inline: over the inner communicator
  sends.push_back(p.sender->send(small, 1, 200));
  // Received in another order than sent: 3, 5, 0, the small one, 4, 1, 2.
  std::vector<torch::Tensor> got(6);
  std::vector<work_ptr> recvs;
  auto small_got = torch::zeros({16});
  for (std::uint32_t tag : {3u, 5u, 0u, 99u, 4u, 1u, 2u}) {
    if (tag == 99) {
      recvs.push_back(p.receiver->recv(small_got, 0, 200));
      continue;
    }
    got[tag] = torch::zeros({big});
    recvs.push_back(p.receiver->recv(got[tag], 0, 100 + tag));
  }
  for (auto& w : recvs) w->wait_or_throw(10s);
  for (auto& w : sends) w->wait_or_throw(10s);
  for (int i = 0; i < 6; ++i) EXPECT_TRUE(torch::equal(got[i], sent[i])) << "tag " << 100 + i;
  EXPECT_TRUE(torch::equal(small_got, small));
  EXPECT_EQ(p.out->sends.load(), 6);  // the big ones over the link, the small one not
  EXPECT_EQ(p.in->recvs.load(), 6);
}

TEST(OrderedP2p, AReceiveWaitsForTheReceivesOfEarlierSends) {
  pair p;
  auto a = torch::full({big}, 1.0f), b = torch::full({big}, 2.0f);
  auto sa = p.sender->send(a, 1, 1), sb = p.sender->send(b, 1, 2);
  auto got_b = torch::zeros({big});
  auto rb = p.receiver->recv(got_b, 0, 2);
  // b is the second send on the link: its receive is posted only with the first's.
  EXPECT_FALSE(rb->wait(200ms));
  EXPECT_EQ(p.in->recvs.load(), 0);
  auto got_a = torch::zeros({big});
  auto ra = p.receiver->recv(got_a, 0, 1);
  ra->wait_or_throw(10s);
  rb->wait_or_throw(10s);
  sa->wait_or_throw(10s);
  sb->wait_or_throw(10s);
  EXPECT_TRUE(torch::equal(got_a, a));
  EXPECT_TRUE(torch::equal(got_b, b));
}

TEST(OrderedP2p, SizeMismatchFailsThatReceiveAndTheLinkStaysInStep) {
  pair p;
  auto a = torch::full({big}, 1.0f), b = torch::full({big}, 2.0f);
  auto sa = p.sender->send(a, 1, 1), sb = p.sender->send(b, 1, 2);
  auto wrong = torch::zeros({big + 8});
  auto ra = p.receiver->recv(wrong, 0, 1);
  EXPECT_THROW(ra->wait_or_throw(10s), transport_error);
  EXPECT_NE(ra->error().find("32768 bytes were sent, the receive takes 32800"), std::string::npos) << ra->error();
  EXPECT_TRUE(torch::equal(wrong, torch::zeros({big + 8})));  // nothing written into it
  auto got_b = torch::zeros({big});
  p.receiver->recv(got_b, 0, 2)->wait_or_throw(10s);
  EXPECT_TRUE(torch::equal(got_b, b));
  sb->wait_or_throw(10s);
}

TEST(OrderedP2p, AReceiveAbortedBeforeItsTurnTakesNothingAndLaterOnesStillArrive) {
  pair p;
  auto a = torch::full({big}, 1.0f), b = torch::full({big}, 2.0f);
  auto got_b = torch::zeros({big}), got_a = torch::zeros({big});
  auto rb = p.receiver->recv(got_b, 0, 2);
  auto ra = p.receiver->recv(got_a, 0, 1);
  ra->abort("not wanted");
  auto sa = p.sender->send(a, 1, 1), sb = p.sender->send(b, 1, 2);
  rb->wait_or_throw(10s);
  EXPECT_TRUE(torch::equal(got_b, b));
  EXPECT_TRUE(torch::equal(got_a, torch::zeros({big})));
  sa->wait_or_throw(10s);
  sb->wait_or_throw(10s);
}

TEST(OrderedP2p, AbortFailsWaitingReceives) {
  pair p;
  auto b = torch::full({big}, 2.0f);
  p.sender->send(torch::full({big}, 1.0f), 1, 1);
  p.sender->send(b, 1, 2);
  auto got_b = torch::zeros({big});
  auto rb = p.receiver->recv(got_b, 0, 2);  // waits for seq 0's receive, which never comes
  EXPECT_FALSE(rb->wait(100ms));
  p.receiver->abort("step aborted");
  EXPECT_THROW(rb->wait_or_throw(10s), transport_error);
  EXPECT_NE(rb->error().find("step aborted"), std::string::npos) << rb->error();
  // Later receives fail at once.
  auto again = p.receiver->recv(torch::zeros({big}), 0, 3);
  EXPECT_THROW(again->wait_or_throw(10s), transport_error);
}

TEST(OrderedP2p, LinksMustCoverEveryRank) {
  auto inner = make_local_group(3);
  EXPECT_THROW(ordered_p2p(inner[0], {nullptr}, {}), std::invalid_argument);
}
