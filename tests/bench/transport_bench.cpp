// Transport benchmark (docs/performance.md): point-to-point bandwidth between two
// processes and collective bus bandwidth (nccl-tests' definition) of Troupe's UCX backend
// and of LibTorch's c10d::ProcessGroupGloo, measured in the same processes.
//
//   troupe_transport_bench p2p  [TLS]        2 processes, 4 KiB .. 64 MiB, window of 16
//   troupe_transport_bench coll N [TLS]      N processes, 1 MiB .. 64 MiB (and lat's figure)
//   troupe_transport_bench lat N [TLS]       N processes, a one-element all-reduce's latency
//   (TLS: UCX_TLS for the run, default sm,self; the gloo side always uses TCP loopback)
//
// The parent starts the ranks (same binary, "rank" mode) and prints rank 0's table.
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <iostream>

#include "bench_util.hpp"
#include "transport/ucx/ucx_communicator.hpp"

using namespace troupe::transport;
namespace {

using namespace troupe::bench;

void p2p(communicator& c) {
  if (c.rank() == 0) std::printf("| bytes | troupe ucx send/recv MB/s |\n| --- | --- |\n");
  for (std::int64_t bytes = 4096; bytes <= (64 << 20); bytes *= 4) {
    const int iters = int(std::max<std::int64_t>(4, std::min<std::int64_t>(2000, (1ll << 30) / bytes)));
    const double best = stream_mb_per_s(c, torch::ones({bytes / 4}), 16, iters);
    if (c.rank() == 0) std::printf("| %lld | %.0f |\n", (long long)bytes, best);
  }
}

// Ping-pong: rank 0 sends, rank 1 answers with the same size; the median round trip / 2
// (as ucx_perftest's tag_lat reports it). What a message costs beyond the wire: the
// caller's hand-off to the progress thread and the completion back.
void p2p_latency(communicator& c) {
  if (c.rank() == 0) std::printf("\n| bytes | troupe ucx one-way latency us (median of ping-pongs) |\n| --- | --- |\n");
  for (std::int64_t bytes : {8ll, 4096ll, 65536ll, 524288ll}) {
    const int iters = bytes >= 65536 ? 300 : 1000;
    auto out = torch::ones({bytes / 4}), in = torch::empty({bytes / 4});
    const double rtt = time_median(
        iters,
        [&] {
          if (c.rank() == 0) {
            auto r = c.recv(in, 1, 5);
            c.send(out, 1, 5)->wait_or_throw(kTimeout);
            r->wait_or_throw(kTimeout);
          } else {
            c.recv(in, 0, 5)->wait_or_throw(kTimeout);
            c.send(out, 0, 5)->wait_or_throw(kTimeout);
          }
        },
        20);
    if (c.rank() == 0) std::printf("| %lld | %.1f |\n", (long long)bytes, rtt / 2 * 1e6);
  }
}

// Latency: a one-element all-reduce, median of 300 calls, troupe and gloo.
void coll_latency(communicator& c, c10d::ProcessGroupGloo& gloo) {
  auto one = torch::ones({1});
  const double u = time_median(300, [&] { c.all_reduce(one)->wait_or_throw(kTimeout); });
  const double g = time_median(300, [&] {
    std::vector<torch::Tensor> v{one};
    gloo.allreduce(v)->wait();
  });
  if (c.rank() == 0)
    std::printf("one-element all_reduce, median of 300: troupe %.1f us, gloo %.1f us\n", u * 1e6, g * 1e6);
}

void coll(communicator& c, c10d::ProcessGroupGloo& gloo) {
  const int n = c.size(), r = c.rank();
  coll_latency(c, gloo);
  if (r == 0)
    std::printf("\n| collective | ranks | bytes | troupe ucx busbw GB/s | gloo busbw GB/s | ratio |\n"
                "| --- | --- | --- | --- | --- | --- |\n");
  for (std::int64_t bytes : {1ll << 20, 4ll << 20, 16ll << 20, 64ll << 20}) {
    const std::int64_t count = bytes / 4 / n * n;  // equal pieces (gloo's allgather needs them)
    // Best of many for the small sizes: single runs of a few ms vary by 2x on a busy VM.
    const int reps = bytes >= (64 << 20) ? 3 : bytes >= (16 << 20) ? 5 : bytes >= (4 << 20) ? 15 : 30;
    auto t = torch::ones({count});
    auto piece_t = torch::ones({count / n});
    const double ar_factor = 2.0 * (n - 1) / n, rs_factor = double(n - 1) / n;
    struct row {
      const char* name;
      double factor, ucx, gloo;
    };
    std::vector<row> rows;
    rows.push_back({"all_reduce", ar_factor,
                    time_best(reps, [&] { c.all_reduce(t)->wait_or_throw(kTimeout); }),
                    time_best(reps, [&] {
                      std::vector<torch::Tensor> v{t};
                      gloo.allreduce(v)->wait();
                    })});
    double gloo_rs = -1;
    try {
      gloo_rs = time_best(reps, [&] {
        std::vector<torch::Tensor> out{piece_t};
        std::vector<std::vector<torch::Tensor>> in(1);
        for (int k = 0; k < n; ++k) in[0].push_back(t.narrow(0, k * (count / n), count / n));
        gloo.reduce_scatter(out, in)->wait();
      });
    } catch (const std::exception&) {
      // LibTorch 1.13's gloo has no reduce_scatter: reported as n/a.
    }
    rows.push_back({"reduce_scatter", rs_factor,
                    time_best(reps, [&] { c.reduce_scatter(t, piece_t)->wait_or_throw(kTimeout); }), gloo_rs});
    rows.push_back({"all_gather", rs_factor,
                    time_best(reps, [&] { c.all_gather(piece_t, t)->wait_or_throw(kTimeout); }),
                    time_best(reps, [&] {
                      std::vector<std::vector<torch::Tensor>> outs(1);
                      for (int k = 0; k < n; ++k) outs[0].push_back(t.narrow(0, k * (count / n), count / n));
                      std::vector<torch::Tensor> in{piece_t};
                      gloo.allgather(outs, in)->wait();
                    })});
    // All-to-all with equal pieces (what expert parallelism's dispatch does with a balanced
    // router): count / n elements to every rank.
    const std::vector<std::int64_t> pieces(std::size_t(n), count / n);
    auto t_out = torch::empty({count});
    double gloo_a2a = -1;
    try {
      gloo_a2a = time_best(reps, [&] {
        auto out_split = pieces, in_split = pieces;  // (gloo takes them over)
        gloo.alltoall_base(t_out, t, out_split, in_split)->wait();
      });
    } catch (const std::exception&) {
    }
    rows.push_back({"all_to_all", rs_factor,
                    time_best(reps, [&] { c.all_to_all(t, pieces, t_out, pieces)->wait_or_throw(kTimeout); }),
                    gloo_a2a});
    if (r == 0)
      for (auto& x : rows) {
        const double b = double(count) * 4;
        const double u = b / x.ucx * x.factor / 1e9;
        if (x.gloo > 0) {
          const double g = b / x.gloo * x.factor / 1e9;
          std::printf("| %s | %d | %lld | %.2f | %.2f | %.1fx |\n", x.name, n, (long long)b, u, g, u / g);
        } else {
          std::printf("| %s | %d | %lld | %.2f | n/a (not in this LibTorch's gloo) | |\n", x.name, n, (long long)b, u);
        }
      }
  }
}

int run_rank(const std::string& mode, int rank, int size, const std::string& dir) {
  torch::set_num_threads(1);
  ucx_options uo;  // TROUPE_BENCH_DIRECT_MAX_BYTES: another direct-exchange threshold (0: ring only)
  if (const char* tls = std::getenv("UCX_TLS")) uo.tls = tls;  // (the progress loop's spin follows it)
  if (const char* d = std::getenv("TROUPE_BENCH_DIRECT_MAX_BYTES")) uo.direct_max_bytes = std::stoll(d);
  // TROUPE_BENCH_DRIVE=0: collectives without ucx_options::drive (A/B)
  if (const char* d = std::getenv("TROUPE_BENCH_DRIVE")) uo.drive = std::string(d) != "0";
  auto comm = make_ucx_communicator(rank, size, folder_exchange(dir + "/ucx", rank, size), uo);
  auto store = c10::make_intrusive<c10d::FileStore>(dir + "/gloo-store", size);
  auto opts = c10d::ProcessGroupGloo::Options::create(std::chrono::seconds(120));
  opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  c10d::ProcessGroupGloo gloo(store, rank, size, opts);
  if (mode == "p2p") {
    p2p(*comm);
    p2p_latency(*comm);
  } else if (mode == "lat") {
    coll_latency(*comm, gloo);
  } else {
    coll(*comm, gloo);
  }
  std::fflush(stdout);
  gloo.barrier()->wait();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string mode = argc > 1 ? argv[1] : "";
    if (mode == "rank") return run_rank(argv[2], std::stoi(argv[3]), std::stoi(argv[4]), argv[5]);
    if (mode != "p2p" && mode != "coll" && mode != "lat") {
      std::cerr << "usage: troupe_transport_bench p2p [TLS] | coll N [TLS] | lat N [TLS]\n";
      return 2;
    }
    const int n = mode == "p2p" ? 2 : std::stoi(argc > 2 ? argv[2] : "2");
    const std::string tls = argc > (mode == "p2p" ? 2 : 3) ? argv[mode == "p2p" ? 2 : 3] : "sm,self";
    return run_ranks(argv[0], n, {mode}, tls, "UCX_TLS=" + tls + ", " + std::to_string(n) + " processes");
  } catch (const std::exception& e) {
    std::cerr << "troupe_transport_bench: " << e.what() << "\n";
    return 1;
  }
}
