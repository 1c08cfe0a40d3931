// transport/: the local backend in one process (threads), and the UCX backend's options.
// Staging through host or device memory: host_staging_test.cpp; the UCX backend over 2,
// 3 and 4 processes: transport_processes_test.cpp.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <functional>
#include <optional>
#include <thread>
#include <tuple>

#include "launch/environment.hpp"
#include "compute/runtime/device.hpp"
#include "test_util.hpp"
#include "process_group.hpp"
#include "rank_threads.hpp"
#include "transport/host_staging.hpp"
#include "transport/local/local_group.hpp"
#include "transport/ucx/ucx_communicator.hpp"

using namespace troupe;
using namespace troupe::transport;
using test::inputs;
using test::on_threads;


TEST(Transport, PiecesCoverUnevenSizes) {
  for (std::int64_t n : {0, 1, 5, 7, 64})
    for (int parts : {1, 2, 3, 4}) {
      std::int64_t next = 0;
      for (int i = 0; i < parts; ++i) {
        auto [b, e] = piece(n, parts, i);
        EXPECT_EQ(b, next);
        EXPECT_LE(e - b, n / parts + 1);
        EXPECT_GE(e - b, n / parts);
        next = e;
      }
      EXPECT_EQ(next, n);
    }
}

TEST(Transport, LocalCollectivesEqualSumsInRingOrder) {
  for (int n : {1, 2, 3, 4})
    for (std::int64_t size : {1, 7, 1000}) {
      auto comms = make_local_group(n);
      auto all = inputs(n, size);
      auto plain = torch::stack(all).sum(0);
      std::vector<torch::Tensor> reduced(n), scattered(n), gathered(n), bcast(n);
      on_threads(n, [&](int r) {
        auto& c = *comms[r];
        reduced[r] = all[r].clone();
        c.all_reduce(reduced[r])->wait_or_throw(std::chrono::seconds(10));
        auto [b, e] = piece(size, n, r);
        scattered[r] = torch::empty({e - b});
        c.reduce_scatter(all[r], scattered[r])->wait_or_throw(std::chrono::seconds(10));
        gathered[r] = torch::empty({size});
        c.all_gather(all[r].narrow(0, b, e - b).clone(), gathered[r])->wait_or_throw(std::chrono::seconds(10));
        bcast[r] = r == 0 ? all[0].clone() : torch::zeros({size});
        c.broadcast(bcast[r], 0)->wait_or_throw(std::chrono::seconds(10));
      });
      for (int r = 0; r < n; ++r) {
        EXPECT_TRUE(torch::allclose(reduced[r], plain, 1e-5, 1e-5));
        auto [b, e] = piece(size, n, r);
        EXPECT_TRUE(torch::equal(scattered[r], reduced[0].narrow(0, b, e - b)));
        EXPECT_TRUE(torch::equal(gathered[r].narrow(0, b, e - b), all[r].narrow(0, b, e - b)));
        EXPECT_TRUE(torch::equal(bcast[r], all[0]));
        EXPECT_TRUE(torch::equal(reduced[r], reduced[0]));
      }
      // The fixed order, checked on piece 0 with 3 ranks: ((x1 + x2) + x0).
      if (n == 3) {
        auto [b, e] = piece(size, n, 0);
        auto want = (all[1].narrow(0, b, e - b) + all[2].narrow(0, b, e - b)) + all[0].narrow(0, b, e - b);
        EXPECT_TRUE(torch::equal(scattered[0], want));
      }
    }
}

TEST(Transport, LocalMismatchAndAbortAreErrors) {
  auto comms = make_local_group(2);
  auto a = torch::ones({4}), b = torch::ones({4});
  auto w0 = comms[0]->all_reduce(a);
  auto w1 = comms[1]->broadcast(b, 0);
  EXPECT_THROW(w0->wait(std::chrono::seconds(1)), transport_error);
  EXPECT_THROW(w1->wait(std::chrono::seconds(1)), transport_error);
  try {
    w0->wait(std::chrono::seconds(1));
  } catch (const transport_error& e) {
    EXPECT_NE(std::string(e.what()).find("collective order mismatch"), std::string::npos) << e.what();
  }
  // A pending collective fails on abort (a peer died) instead of waiting for ever.
  auto w = comms[0]->all_reduce(a);
  EXPECT_FALSE(w->wait(std::chrono::milliseconds(50)));
  comms[1]->abort("rank 1 died");
  EXPECT_THROW(w->wait(std::chrono::seconds(1)), transport_error);
  EXPECT_NE(w->error().find("rank 1 died"), std::string::npos);
  EXPECT_THROW(comms[0]->all_reduce(a)->wait(std::chrono::seconds(1)), transport_error);
}

// The UCX progress loop sleeps at once where UCX_TLS allows TCP only and the machine has
// fewer cores than ranks on it, spins otherwise; TROUPE_UCX_SPIN or an explicit option
// wins. (launch/ reads both variables once: troupe_cli::ucx_options_from.)
TEST(Transport, UcxSpinFollowsTheTransports) {
  const std::vector<std::pair<std::string, int>> cases{
      {"tcp", 0}, {"tcp,self", 0}, {"self,tcp", 0}, {"sm,self", 2000}, {"tcp,sm,self", 2000},
      {"rc,tcp", 2000}, {"^sm", 2000}, {"all", 2000}};
  const int crowded = int(std::thread::hardware_concurrency()) + 1;
  for (const auto& [value, want] : cases) {
    const auto o = troupe_cli::ucx_options_from(nullptr, value.c_str());
    EXPECT_EQ(o.tls, value);
    EXPECT_EQ(resolve_spin(o.spin, crowded, o.tls), want) << value;
    EXPECT_EQ(resolve_spin(o.spin, 1, o.tls), 2000) << value << ": a core per rank";
  }
  EXPECT_EQ(resolve_spin(-1), 2000);
  EXPECT_EQ(resolve_spin(7, crowded, "tcp"), 7);
  const auto spin = troupe_cli::ucx_options_from("300", "tcp");
  EXPECT_EQ(resolve_spin(spin.spin, crowded, spin.tls), 300);
  EXPECT_THROW(troupe_cli::ucx_options_from("many", nullptr), troupe::config_error);
  EXPECT_THROW(troupe_cli::ucx_options_from("3x", nullptr), troupe::config_error);
}

// A sparse UCX communicator (the nodes' world: each node connects to its peers only):
// ranks given no address are not connected; a send to one fails at once with the reason,
// a receive from a rank that connected to this one works, and a rank needs its own
// address. A communicator not made sparse refuses an empty address.
TEST(Transport, ASparseUcxCommunicatorSendsOnlyToTheRanksItConnected) {
  auto sparse = process_ucx_options();
  sparse.sparse = true;
  std::vector<std::unique_ptr<ucx_pending>> pending;
  std::vector<std::string> a;
  for (int r = 0; r < 3; ++r) {
    pending.push_back(prepare_ucx_communicator(r, 3, sparse));
    a.push_back(pending.back()->address());
  }
  auto c0 = pending[0]->connect({a[0], a[1], ""});  // 0 and 2 do not connect to each other
  auto c1 = pending[1]->connect(a);
  auto c2 = pending[2]->connect({"", a[1], a[2]});
  const auto out = torch::arange(6, torch::kFloat32);
  for (const auto& [from, to, c_from, c_to] :
       {std::tuple{0, 1, c0, c1}, std::tuple{1, 0, c1, c0}, std::tuple{2, 1, c2, c1}, std::tuple{1, 2, c1, c2}}) {
    auto in = torch::zeros({6});
    auto r = c_to->recv(in, from, 7);
    c_from->send(out, to, 7)->wait_or_throw(std::chrono::seconds(5));
    r->wait_or_throw(std::chrono::seconds(5));
    EXPECT_TRUE(torch::equal(in, out)) << from << " -> " << to;
  }
  for (const auto& [c, to] : {std::pair{c0, 2}, std::pair{c2, 0}}) {
    auto w = c->send(out, to, 8);
    ASSERT_TRUE(w->done()) << "a send to an unconnected rank fails at once";
    EXPECT_NE(w->error().find("is not connected to rank " + std::to_string(to)), std::string::npos) << w->error();
  }
  auto lone = prepare_ucx_communicator(0, 2, sparse);
  EXPECT_THROW(lone->connect({"", a[1]}), transport_error);  // no address of its own
  auto strict = prepare_ucx_communicator(0, 2);
  EXPECT_THROW(strict->connect({strict->address(), ""}), transport_error);
}

TEST(Transport, LocalSendRecvAndCompletionCallbacks) {
  auto comms = make_local_group(2);
  auto out = torch::arange(10, torch::kFloat32), in = torch::empty({10});
  std::string seen = "not called";
  auto r = comms[1]->recv(in, 0, 3);
  r->on_complete([&](const std::string& err) { seen = err; });
  EXPECT_FALSE(r->done());
  comms[0]->send(out, 1, 3)->wait_or_throw(std::chrono::seconds(1));
  EXPECT_TRUE(r->done());
  EXPECT_EQ(seen, "");
  EXPECT_TRUE(torch::equal(in, out));
  auto short_in = torch::empty({3});
  auto r2 = comms[1]->recv(short_in, 0, 4);
  comms[0]->send(out, 1, 4);
  EXPECT_THROW(r2->wait(std::chrono::seconds(1)), transport_error);
  EXPECT_THROW(comms[0]->all_reduce(torch::ones({2, 2}).t()), std::invalid_argument);  // not contiguous
}
