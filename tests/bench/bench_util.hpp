#pragma once
// Timing helpers of the transport benchmarks (troupe_transport_bench, troupe_staging_bench).
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

#include "../support/process_group.hpp"
#include "../support/temp_dir.hpp"
#include "transport/transport.hpp"

namespace troupe::bench {

using clk = std::chrono::steady_clock;
inline const auto kTimeout = std::chrono::seconds(120);

inline double seconds_since(clk::time_point t) { return std::chrono::duration<double>(clk::now() - t).count(); }

/// Median seconds of `reps` calls of f, after `warmup` calls.
inline double time_median(int reps, const std::function<void()>& f, int warmup = 1) {
  for (int i = 0; i < warmup; ++i) f();
  std::vector<double> ts;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = clk::now();
    f();
    ts.push_back(seconds_since(t0));
  }
  std::nth_element(ts.begin(), ts.begin() + ts.size() / 2, ts.end());
  return ts[ts.size() / 2];
}

/// Fewest seconds of `reps` calls of f, after one warm-up call.
inline double time_best(int reps, const std::function<void()>& f) {
  double best = 1e30;
  f();
  for (int i = 0; i < reps; ++i) {
    const auto t0 = clk::now();
    f();
    best = std::min(best, seconds_since(t0));
  }
  return best;
}

/// Rank 0 streams `iters` messages of `like`'s size to rank 1, `window` in flight (posted
/// in groups of `window`), the receiver acknowledging the last one (as ucx_perftest's
/// tag_bw does); best of 3 in MB/s (10^6 bytes) on rank 0. Buffers are `like`'s kind.
inline double stream_mb_per_s(transport::communicator& c, const torch::Tensor& like, int window, int iters) {
  const double bytes = double(like.numel()) * double(like.element_size());
  auto ack = torch::zeros({1});
  std::vector<torch::Tensor> bufs;
  for (int i = 0; i < window; ++i) bufs.push_back(c.rank() == 0 ? like : torch::empty_like(like));
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    const auto t0 = clk::now();
    for (int i = 0; i < iters; i += window) {
      std::vector<transport::work_ptr> ws;
      for (int k = 0; k < window && i + k < iters; ++k)
        ws.push_back(c.rank() == 0 ? c.send(bufs[k], 1, std::uint32_t(k)) : c.recv(bufs[k], 0, std::uint32_t(k)));
      for (auto& w : ws) w->wait_or_throw(kTimeout);
    }
    if (c.rank() == 0)
      c.recv(ack, 1, 999)->wait_or_throw(kTimeout);
    else
      c.send(ack, 0, 999)->wait_or_throw(kTimeout);
    best = std::max(best, bytes * iters / seconds_since(t0) / 1e6);
  }
  return best;
}

/// Runs `n` ranks, each this binary (`self`) with "rank", `args`, its rank, `n` and a
/// scratch folder, under UCX_TLS=`tls`; prints `title` and rank 0's output. 1 when a rank
/// failed (its output on stderr), else 0.
inline int run_ranks(const std::string& self, int n, const std::vector<std::string>& args, const std::string& tls,
                     const std::string& title) {
  test::temp_dir dir;
  test::process_group group(
      n,
      [&](int r) {
        std::vector<std::string> argv{self, "rank"};
        argv.insert(argv.end(), args.begin(), args.end());
        for (const auto& a : {std::to_string(r), std::to_string(n), dir.path.string()}) argv.push_back(a);
        return argv;
      },
      {"UCX_TLS=" + tls, "OMP_NUM_THREADS=1"}, dir.path.string());
  auto results = group.wait(std::chrono::seconds(580));
  std::cout << title << "\n" << results[0].output;
  for (int r = 0; r < n; ++r)
    if (results[r].status != 0) {
      std::cerr << "rank " << r << " failed (" << results[r].status << "):\n" << results[r].output;
      return 1;
    }
  return 0;
}

}  // namespace troupe::bench
