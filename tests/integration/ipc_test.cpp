// transport/ipc: point-to-point through shared buffers in one process (over the local
// backend, POSIX shared memory); between processes: ipc_processes_test.cpp.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <dirent.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <thread>

#include "compute/runtime/device.hpp"
#include "counting_memory.hpp"
#include "process_group.hpp"
#include "temp_dir.hpp"
#include "transport/ipc/ipc.hpp"
#include "transport/local/local_group.hpp"

using namespace troupe;
using namespace troupe::transport;

namespace {

const auto kWait = std::chrono::seconds(10);

/// Names this process left in /dev/shm.
int shm_left() {
  const std::string prefix = "troupe-ipc-" + std::to_string(::getpid()) + "-";
  int n = 0;
  if (DIR* d = ::opendir("/dev/shm")) {
    while (auto* e = ::readdir(d))
      if (std::string(e->d_name).rfind(prefix, 0) == 0) ++n;
    ::closedir(d);
  }
  return n;
}

/// Ranks over the local backend, rank r on machine `machine[r]`.
struct ipc_group {
  explicit ipc_group(std::vector<int> machine, ipc_options opts = {}) {
    const auto inner = make_local_group(int(machine.size()));
    for (std::size_t r = 0; r < machine.size(); ++r) {
      std::vector<bool> same;
      for (int m : machine) same.push_back(m == machine[r]);
      memory.push_back(std::make_shared<test::counting_memory>(host_ipc_memory()));
      comms.push_back(ipc_p2p(inner[r], memory.back(), same, opts));
    }
  }
  std::vector<std::shared_ptr<test::counting_memory>> memory;
  std::vector<std::shared_ptr<communicator>> comms;

  /// Sends `n` ones from rank 0 to rank 1 with `tag`: true when they arrived.
  bool delivers(std::int64_t n, std::uint32_t tag) {
    auto dst = torch::zeros({n});
    auto r = comms[1]->recv(dst, 0, tag);
    comms[0]->send(torch::ones({n}), 1, tag)->wait_or_throw(kWait);
    r->wait_or_throw(kWait);
    return torch::equal(dst, torch::ones({n}));
  }
};

}  // namespace

// Ranks 0 and 1 share a machine, rank 2 is elsewhere: between 0 and 1 tensors above the
// inline size go through buffers (at most one per message in flight, reused), all
// others over the inner backend; every element arrives, inputs stay untouched, collectives
// pass through, and nothing is left in /dev/shm.
TEST(Ipc, SendRecvThroughSharedBuffersEqualsTheBackend) {
  {
    ipc_group g({0, 0, 1});
    EXPECT_NE(g.comms[0]->backend().find("through shared host memory"), std::string::npos) << g.comms[0]->backend();
    for (std::int64_t n : {std::int64_t(3), std::int64_t(5000), std::int64_t(300000)})
      for (int round = 0; round < 3; ++round) {
        struct message {
          int src, dst, k;
        };
        std::vector<message> messages;  // two in flight per ordered pair
        for (int src = 0; src < 3; ++src)
          for (int dst = 0; dst < 3; ++dst)
            for (int k = 0; k < 2 && src != dst; ++k) messages.push_back({src, dst, k});
        auto expected = [&](const message& m) {
          return torch::arange(n, torch::kFloat32) + float(100 * m.src + 10 * m.dst + m.k + round);
        };
        std::vector<torch::Tensor> got, sent;
        std::vector<work_ptr> works;
        for (const auto& m : messages) {  // every receive posted before any send
          got.push_back(torch::full({n}, -1.0f));
          works.push_back(g.comms[m.dst]->recv(got.back(), m.src, std::uint32_t(m.k)));
        }
        for (const auto& m : messages) {
          sent.push_back(expected(m));
          works.push_back(g.comms[m.src]->send(sent.back(), m.dst, std::uint32_t(m.k)));
        }
        for (auto& w : works) w->wait_or_throw(kWait);
        for (std::size_t i = 0; i < messages.size(); ++i) {
          const auto& m = messages[i];
          EXPECT_TRUE(torch::equal(got[i], expected(m)))
              << n << " elements from " << m.src << " to " << m.dst << " message " << m.k;
          EXPECT_TRUE(torch::equal(sent[i], expected(m)));  // inputs untouched
        }
      }
    // Between 0 and 1 only: for each of the 2 sizes above the inline one, a buffer per
    // message in flight at most (2), reused over the rounds (without reuse: 6 per size).
    for (int r : {0, 1}) {
      EXPECT_GE(g.memory[r]->allocated, 2) << r;
      EXPECT_LE(g.memory[r]->allocated, 4) << r;
      EXPECT_EQ(g.memory[r]->opened, g.memory[1 - r]->allocated) << r;
    }
    EXPECT_EQ(g.memory[2]->allocated + g.memory[2]->opened, 0);
    EXPECT_EQ(shm_left(), 0);  // mapped buffers are unlinked at once

    auto t0 = torch::ones({5000}), t1 = torch::full({5000}, 2.0f), t2 = torch::full({5000}, 3.0f);
    std::vector<work_ptr> ws{g.comms[0]->all_reduce(t0), g.comms[1]->all_reduce(t1), g.comms[2]->all_reduce(t2)};
    for (auto& w : ws) w->wait_or_throw(kWait);
    EXPECT_TRUE(torch::equal(t1, torch::full({5000}, 6.0f)));
  }
  EXPECT_EQ(shm_left(), 0);
}

// A smaller inline limit moves small tensors through buffers too; a send and a receive of
// different sizes fail on both sides naming the sizes; the sender's buffer is free again.
TEST(Ipc, SizeMismatchFailsBothSides) {
  ipc_group g({0, 0}, ipc_options{0});
  auto r = g.comms[1]->recv(torch::zeros({6}), 0, 4);
  auto s = g.comms[0]->send(torch::ones({5}), 1, 4);
  EXPECT_THROW(r->wait(kWait), transport_error);
  EXPECT_THROW(s->wait(kWait), transport_error);
  EXPECT_NE(r->error().find("sent 20 bytes, the receive takes 24"), std::string::npos) << r->error();
  EXPECT_NE(s->error().find("sent 20 bytes, the receive takes 24"), std::string::npos) << s->error();
  EXPECT_TRUE(g.delivers(5, 4));
  EXPECT_EQ(g.memory[0]->allocated, 1);  // the refused message's buffer was reused
}

// An aborted receive fails with its caller's reason and leaves the tensor as it was; a
// communicator's abort fails pending sends and receives; bad tags, ranks and tensors are
// the caller's error before anything moves.
TEST(Ipc, AbortsAndBadCallsAreErrors) {
  ipc_group g({0, 0});
  auto dst = torch::full({10000}, 5.0f);
  auto w = g.comms[1]->recv(dst, 0, 9);
  EXPECT_FALSE(w->wait(std::chrono::milliseconds(20)));
  w->abort("the step was aborted");
  EXPECT_THROW(w->wait(kWait), transport_error);
  EXPECT_NE(w->error().find("the step was aborted"), std::string::npos) << w->error();
  EXPECT_TRUE(g.delivers(10000, 10));
  EXPECT_TRUE(torch::equal(dst, torch::full({10000}, 5.0f)));

  auto s = g.comms[0]->send(torch::ones({10000}), 1, 11);  // never received
  auto r = g.comms[0]->recv(torch::zeros({10000}), 1, 12);
  EXPECT_FALSE(s->wait(std::chrono::milliseconds(20)));
  g.comms[0]->abort("rank 1 died");
  EXPECT_THROW(s->wait(kWait), transport_error);
  EXPECT_THROW(r->wait(kWait), transport_error);
  EXPECT_NE(s->error().find("rank 1 died"), std::string::npos) << s->error();

  ipc_group h({0, 0});
  EXPECT_THROW(h.comms[0]->send(torch::ones({10000}), 1, 1u << 31), std::invalid_argument);
  EXPECT_THROW(h.comms[0]->send(torch::ones({10000}), 2, 1), std::invalid_argument);
  EXPECT_THROW(h.comms[0]->recv(torch::ones({2, 10000}).t(), 1, 1), std::invalid_argument);
  EXPECT_THROW(ipc_p2p(make_local_group(2)[0], host_ipc_memory(), {true}), std::invalid_argument);
  EXPECT_EQ(h.memory[0]->allocated, 0);
}

// The key nodes compare to find the nodes of their machine names the boot and the IPC
// namespace, and stays the same.
TEST(Ipc, MachineKeyNamesTheBootAndTheIpcNamespace) {
  const auto key = machine_key();
  EXPECT_NE(key.find("/ipc:["), std::string::npos) << key;
  EXPECT_EQ(key, machine_key());
}

// Without a GPU, CUDA IPC memory is a clear error (the nodes then log it and keep UCX).
TEST(Ipc, CudaMemoryWithoutAGpuIsAClearError) {
  if (cuda_usable()) GTEST_SKIP() << "a GPU is here";
  try {
    cuda_ipc_memory(0);
    FAIL() << "cuda_ipc_memory(0) without a GPU";
  } catch (const transport_error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(cuda_ipc_built() ? "cuda ipc: " : "no CUDA IPC"), std::string::npos) << what;
  }
}
