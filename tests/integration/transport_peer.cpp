// One rank of a multi-process transport check (started by tests/integration/transport_test.cpp and
// tests/bench/transport_bench.cpp through tests/support/process_group.hpp).
//
//   troupe_transport_peer check    RANK SIZE DIR   collectives and send/recv, compared with
//                                                  the ring-order reference (bit-exact) and
//                                                  with c10d::ProcessGroupGloo
//   troupe_transport_peer mismatch RANK SIZE DIR   rank 0 calls all_reduce, the others
//                                                  all_gather: every rank must get an error
//   troupe_transport_peer abort    0|1 2 DIR       rank 0 aborts while its all-to-all and
//                                                  send wait on rank 1, which never
//                                                  receives: both fail at once
//
// Prints one line per failed check to stderr; exit status 0 when all checks passed.
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/torch.h>

#include <cstdio>
#include <iostream>
#include <string>

#include "transport/ucx/ucx_communicator.hpp"

using namespace troupe::transport;

namespace {

int failures = 0;

void fail(const std::string& what) {
  std::cerr << "FAIL: " << what << std::endl;
  ++failures;
}

/// Rank r's input of a collective: deterministic, different per rank, size and dtype.
torch::Tensor input_of(int r, std::int64_t n, torch::ScalarType dt) {
  torch::manual_seed(1000 * r + n);
  if (dt == torch::kInt64) return torch::randint(-1000, 1000, {n}, torch::kInt64);
  return torch::randn({n}, dt);
}

void check_equal(const torch::Tensor& got, const torch::Tensor& want, const std::string& what) {
  if (!torch::equal(got, want)) fail(what + ": differs from the ring-order reference");
}

void check_close(const torch::Tensor& got, const torch::Tensor& want, const std::string& what) {
  if (got.scalar_type() == torch::kInt64 ? !torch::equal(got, want) : !torch::allclose(got, want, 1e-5, 1e-5))
    fail(what + ": differs from gloo (max abs diff " +
         std::to_string((got.to(torch::kFloat64) - want.to(torch::kFloat64)).abs().max().item<double>()) + ")");
}

std::shared_ptr<c10d::ProcessGroupGloo> make_gloo(const std::string& dir, int rank, int size) {
  auto store = c10::make_intrusive<c10d::FileStore>(dir + "/gloo-store", size);
  auto opts = c10d::ProcessGroupGloo::Options::create(std::chrono::seconds(120));
  opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  return std::make_shared<c10d::ProcessGroupGloo>(store, rank, size, opts);
}

void run_check(communicator& comm, c10d::ProcessGroupGloo& gloo, std::int64_t max_size) {
  const int rank = comm.rank(), n = comm.size();
  const auto timeout = std::chrono::seconds(120);
  const std::vector<std::int64_t> sizes{1, 2, 3, 5, 1000, 4099, 262147, 16 << 20};  // up to 64 MiB of float32
  for (auto dt : {torch::kFloat32, torch::kInt64}) {
    for (auto size : sizes) {
      if (size > max_size || (dt == torch::kInt64 && size > (1 << 20))) continue;
      const auto tag = std::string(dt == torch::kFloat32 ? "float32" : "int64") + " n=" + std::to_string(size);
      std::vector<torch::Tensor> all;
      for (int r = 0; r < n; ++r) all.push_back(input_of(r, size, dt));
      // Reference: every piece summed in the ring's order.
      auto want = torch::empty({size}, dt);
      for (int i = 0; i < n; ++i) {
        auto [b, e] = piece(size, n, i);
        std::vector<torch::Tensor> parts;
        for (auto& t : all) parts.push_back(t.narrow(0, b, e - b));
        ring_order_sum(want.narrow(0, b, e - b), parts, i);
      }
      // all_reduce
      auto t = all[rank].clone();
      comm.all_reduce(t)->wait_or_throw(timeout);
      check_equal(t, want, "all_reduce " + tag);
      std::vector<torch::Tensor> g{all[rank].clone()};
      gloo.allreduce(g)->wait();
      check_close(t, g[0], "all_reduce " + tag);
      if (size > (1 << 20)) continue;  // 64 MiB: all_reduce only (CI time)
      // reduce_scatter
      auto [b, e] = piece(size, n, rank);
      auto out = torch::empty({e - b}, dt);
      comm.reduce_scatter(all[rank], out)->wait_or_throw(timeout);
      check_equal(out, want.narrow(0, b, e - b), "reduce_scatter " + tag);
      // all_gather (uneven pieces included)
      auto gathered = torch::empty({size}, dt);
      comm.all_gather(all[rank].narrow(0, b, e - b).clone(), gathered)->wait_or_throw(timeout);
      std::vector<torch::Tensor> pieces;
      for (int r = 0; r < n; ++r) {
        auto [rb, re] = piece(size, n, r);
        pieces.push_back(all[r].narrow(0, rb, re - rb));
      }
      check_equal(gathered, torch::cat(pieces), "all_gather " + tag);
      // in place: the input is the output's own piece
      auto in_place = torch::zeros({size}, dt);
      in_place.narrow(0, b, e - b).copy_(all[rank].narrow(0, b, e - b));
      comm.all_gather(in_place.narrow(0, b, e - b), in_place)->wait_or_throw(timeout);
      check_equal(in_place, torch::cat(pieces), "all_gather in place " + tag);
      if (size % n == 0) {  // gloo's allgather needs equal pieces
        std::vector<std::vector<torch::Tensor>> outs(1);
        for (int r = 0; r < n; ++r) outs[0].push_back(torch::empty({size / n}, dt));
        std::vector<torch::Tensor> in{all[rank].narrow(0, b, e - b).clone()};
        gloo.allgather(outs, in)->wait();
        check_close(gathered, torch::cat(outs[0]), "all_gather " + tag);
      }
      // broadcast from the last rank
      auto bc = rank == n - 1 ? all[rank].clone() : torch::zeros({size}, dt);
      comm.broadcast(bc, n - 1)->wait_or_throw(timeout);
      check_equal(bc, all[n - 1], "broadcast " + tag);
    }
  }
  // Point-to-point around the ring, 4 bytes .. 64 MiB.
  for (std::int64_t bytes = 4; bytes <= (64 << 20); bytes *= 16) {
    const auto count = bytes / 4;
    const int right = (rank + 1) % n, left = (rank + n - 1) % n;
    auto mine = input_of(rank, count, torch::kFloat32);
    auto in = torch::empty({count}, torch::kFloat32);
    auto r = comm.recv(in, left, 7);
    auto s = comm.send(mine, right, 7);
    r->wait_or_throw(timeout);
    s->wait_or_throw(timeout);
    check_equal(in, input_of(left, count, torch::kFloat32), "send/recv " + std::to_string(bytes) + " bytes");
  }
  // A receive of the wrong size is an error, not a crash.
  if (n >= 2) {
    if (rank == 0) comm.send(torch::ones({100}), 1, 9)->wait_or_throw(timeout);
    if (rank == 1) {
      try {
        comm.recv(torch::empty({10}), 0, 9)->wait_or_throw(timeout);
        fail("a too-short receive succeeded");
      } catch (const transport_error& e) {
        if (std::string(e.what()).find("size mismatch") == std::string::npos)
          fail(std::string("too-short receive: unexpected error: ") + e.what());
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) {
    std::cerr << "usage: troupe_transport_peer check|mismatch|abort RANK SIZE DIR\n";
    return 2;
  }
  const std::string mode = argv[1], dir = argv[4];
  const int rank = std::stoi(argv[2]), size = std::stoi(argv[3]);
  torch::set_num_threads(1);
  try {
    if (mode == "check") {
      auto gloo = make_gloo(dir, rank, size);
      // The ring for every size (3 ranks and more: the sizes up to 1 MiB go by direct
      // exchange below).
      if (size >= 3) {
        ucx_options ring;
        ring.direct_max_bytes = 0;
        auto ring_comm = make_ucx_communicator(rank, size, folder_exchange(dir + "/ucx-ring", rank, size), ring);
        run_check(*ring_comm, *gloo, 1 << 20);
        gloo->barrier()->wait();
      }
      auto comm = make_ucx_communicator(rank, size, folder_exchange(dir + "/ucx", rank, size));
      run_check(*comm, *gloo, 1 << 30);
      gloo->barrier()->wait();  // nobody closes while others still talk
    } else if (mode == "mismatch") {
      ucx_options opts;
      opts.timeout = std::chrono::seconds(5);
      auto gloo = make_gloo(dir, rank, size);
      auto comm = make_ucx_communicator(rank, size, folder_exchange(dir + "/ucx", rank, size), opts);
      // Every rank connected before any fails: a rank that fails first and exits takes its
      // shared-memory segments along, and a slower one still connecting to it would fail
      // with "Shared memory error" instead of the mismatch (seen once).
      gloo->barrier()->wait();
      auto t = torch::ones({1000});
      try {
        if (rank == 0)
          comm->all_reduce(t)->wait_or_throw(std::chrono::seconds(20));
        else
          comm->all_gather(t.narrow(0, 0, piece(1000, size, rank).second - piece(1000, size, rank).first).clone(), t)
              ->wait_or_throw(std::chrono::seconds(20));
        fail("mismatched collectives completed");
      } catch (const transport_error& e) {
        std::cout << "rank " << rank << ": " << e.what() << std::endl;
      }
    } else if (mode == "abort") {
      // Rank 1 is alive but never receives (a frozen peer). Rank 0's all-to-all (a send
      // large enough for UCX's rendezvous, and a receive) and a point-to-point send to it
      // must fail once rank 0 aborts its communicator, not wait for ever: UCX cannot
      // cancel a send.
      auto gloo = make_gloo(dir, rank, size);
      auto comm = make_ucx_communicator(rank, size, folder_exchange(dir + "/ucx", rank, size));
      gloo->barrier()->wait();
      if (rank == 0) {
        const std::int64_t n = 8 << 20;  // 32 MiB of float32
        auto in = torch::ones({2 * n}), out = torch::zeros({2 * n});
        auto a2a = comm->all_to_all(in, {n, n}, out, {n, n});
        auto p2p = comm->send(torch::ones({n}), 1, 7);
        if (a2a->wait(std::chrono::milliseconds(300)) || p2p->wait(std::chrono::milliseconds(1)))
          fail("transfers to a peer that never receives completed");
        comm->abort("rank 1 froze");
        for (const auto& [w, what] : {std::pair{a2a, "all-to-all"}, std::pair{p2p, "send"}}) {
          try {
            if (!w->wait(std::chrono::seconds(5))) fail(std::string(what) + ": still pending 5 s after the abort");
            else fail(std::string(what) + ": succeeded after the abort");
          } catch (const transport_error& e) {
            if (std::string(e.what()).find("rank 1 froze") == std::string::npos)
              fail(std::string(what) + ": the error does not name the abort: " + e.what());
          }
        }
      }
      gloo->barrier()->wait();  // rank 1 exits only now: it stayed alive and silent
    } else {
      std::cerr << "unknown mode " << mode << "\n";
      return 2;
    }
  } catch (const std::exception& e) {
    fail(std::string("rank ") + std::to_string(rank) + ": " + e.what());
  }
  if (failures == 0) std::cout << "rank " << rank << ": ok" << std::endl;
  return failures == 0 ? 0 : 1;
}
