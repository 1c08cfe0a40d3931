// Context parallelism's attention: the bytes one rank holds between the forward and the
// backward (what the graph saved, plus the output) and the time of a forward and backward,
// per comm and C, beside the model's own core on the whole sequence measured in the same
// run. The ranks are threads of this process (an in-process group); the bytes are glibc's
// allocated bytes (mallinfo2) after every rank's forward, less those before, divided by C.
// Then the ring's (p2p's) overlap: how long the attention waited for its shifts
// (cp::ring_totals) with them beside the blocks' compute and waited for at once, over the
// in-process group and over UCX between the threads (shared memory, as between node
// processes of one machine).
// Timings are never asserted (docs/performance.md).
//   build/troupe_cp_bench [SEQ_LEN ...]      (default: 2048 8192)
#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <torch/torch.h>

#include "actors/tp_groups.hpp"
#include "compute/models/parts/attention.hpp"
#include "compute/parallel/context_parallel.hpp"
#include "launch/blas_kernels.hpp"
#include "tests/support/ucx_groups.hpp"

using namespace troupe;

namespace {

std::int64_t allocated() {
  const auto m = mallinfo2();
  return std::int64_t(m.uordblks + m.hblkhd);
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

/// Every thread waits until all `n` have arrived; then `at_once` runs once (on the last).
class barrier {
 public:
  explicit barrier(int n) : n_(n) {}
  template <class F>
  void arrive(F at_once) {
    std::unique_lock<std::mutex> lock(m_);
    const int gen = gen_;
    if (++count_ == n_) {
      at_once();
      count_ = 0;
      ++gen_;
      cv_.notify_all();
      return;
    }
    cv_.wait(lock, [&] { return gen_ != gen; });
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  int n_, count_ = 0, gen_ = 0;
};

struct measure {
  double held_mb = 0, seconds = 0;
};

constexpr std::int64_t B = 1, H = 8, KV = 4, hd = 32;

/// One forward and backward of attention over `ranks` threads (`run(rank, q, k, v)`
/// returns the output); the median of 3 after a warm-up.
template <class Run>
measure time_ranks(int ranks, std::int64_t S, Run run) {
  std::vector<double> times, held;
  for (int round = 0; round < 4; ++round) {
    barrier sync(ranks);
    std::int64_t before = 0, after = 0;
    double start = 0, end = 0;
    std::vector<std::thread> threads;
    for (int r = 0; r < ranks; ++r)
      threads.emplace_back([&, r] {
        torch::set_num_threads(1);
        const auto L = S / ranks;
        auto q = torch::randn({B, H, L, hd}).requires_grad_(true), k = torch::randn({B, KV, L, hd}).requires_grad_(true),
             v = torch::randn({B, KV, L, hd}).requires_grad_(true);
        const auto w = torch::randn({B, H, L, hd});
        sync.arrive([&] {
          before = allocated();
          start = now_s();
        });
        auto out = run(r, q, k, v);
        sync.arrive([&] { after = allocated(); });
        (out * w).sum().backward();
        sync.arrive([&] { end = now_s(); });
      });
    for (auto& t : threads) t.join();
    if (round == 0) continue;  // warm-up
    times.push_back(end - start);
    held.push_back(double(after - before) / ranks / 1e6);
  }
  std::sort(times.begin(), times.end());
  std::sort(held.begin(), held.end());
  return {held[1], times[1]};
}

/// The forward alone (no graph) over `ranks` threads, 4 times: its key/value shifts all
/// run beside a block's compute.
template <class Run>
void forward_ranks(int ranks, std::int64_t S, Run run) {
  for (int round = 0; round < 4; ++round) {
    std::vector<std::thread> threads;
    for (int r = 0; r < ranks; ++r)
      threads.emplace_back([&, r] {
        torch::set_num_threads(1);
        torch::NoGradGuard no_grad;
        const auto L = S / ranks;
        run(r, torch::randn({B, H, L, hd}), torch::randn({B, KV, L, hd}), torch::randn({B, KV, L, hd}));
      });
    for (auto& t : threads) t.join();
  }
}

}  // namespace

int main(int argc, char** argv) {
  run_with_blas_kernels(argv);  // as the troupe command does
  std::vector<std::int64_t> lengths;
  for (int i = 1; i < argc; ++i) lengths.push_back(std::atoll(argv[i]));
  if (lengths.empty()) lengths = {2048, 8192};
  std::printf("attention of %lld x %lld heads (%lld key/value) x %lld, fp32, one thread per rank\n", (long long)B,
              (long long)H, (long long)KV, (long long)hd);
  std::printf("| seq | core | C | held MB per rank | held / whole core's | fwd+bwd s | s / whole core's |\n");
  std::printf("| --- | --- | --- | --- | --- | --- | --- |\n");
  for (const auto S : lengths) {
    const causal_attention model_core(S, torch::kCPU);
    const auto whole = time_ranks(1, S, [&](int, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
      return model_core(q, k, v, 0);
    });
    auto row = [&](const char* core, int C, const measure& m) {
      std::printf("| %lld | %s | %d | %.1f | %.3f | %.3f | %.2f |\n", (long long)S, core, C, m.held_mb,
                  m.held_mb / whole.held_mb, m.seconds, m.seconds / whole.seconds);
    };
    row("model's (whole sequence)", 1, whole);
    row("blockwise (C = 1)", 1,
        time_ranks(1, S, [&](int, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
          return cp::attention(q, k, v, {}, S);
        }));
    for (const auto comm : {cp_comm::p2p, cp_comm::a2a, cp_comm::allgather})
      for (int C : {2, 4}) {
        const auto groups = in_process_groups(C);
        row(cp_comm_name(comm), C,
            time_ranks(C, S, [&](int r, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
              return cp::attention(q, k, v, {r, C, comm, groups[std::size_t(r)]}, S);
            }));
      }
  }
  // The ring's overlap: per rank and pass (the 4 runs of time_ranks), the attention's wait
  // for its shifts with each started before the compute it runs beside, against the same
  // shifts waited for as soon as they start (context_parallel::overlap false: their whole
  // time), alternately.
  std::printf("\nring (p2p) shifts per rank and pass: the attention's wait for them with the overlap and without "
              "it (their whole time), and the share of their time the overlap hides\n"
              "| seq | group | C | pass | s | shifts | waited s, overlapped | waited s, not overlapped | hidden |\n"
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
  for (const auto S : lengths)
    for (const char* over : {"in process", "UCX"})
      for (int C : {2, 4}) {
        const auto groups = std::string(over) == "UCX" ? test::ucx_groups(C) : in_process_groups(C);
        const double per = 4.0 * C;  // (time_ranks' runs x ranks)
        for (const bool backward : {true, false}) {
          double seconds = 0, shifts = 0, waited[2] = {0, 0};
          for (const bool overlap : {false, true}) {
            const auto before = cp::ring_totals();
            auto attention = [&](int r, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
              context_parallel cp{r, C, cp_comm::p2p, groups[std::size_t(r)]};
              cp.overlap = overlap;
              return cp::attention(q, k, v, cp, S);
            };
            const auto t0 = now_s();
            if (backward)
              seconds = time_ranks(C, S, attention).seconds;
            else
              forward_ranks(C, S, attention);
            if (!backward && overlap) seconds = (now_s() - t0) / 4;
            const auto after = cp::ring_totals();
            waited[overlap] = (after.waited_seconds - before.waited_seconds) / per;
            shifts = double(after.shifts - before.shifts) / per;
          }
          std::printf("| %lld | %s | %d | %s | %.3f | %.0f | %.4f | %.4f | %.2f |\n", (long long)S, over, C,
                      backward ? "forward and backward" : "forward", seconds, shifts, waited[1], waited[0],
                      waited[0] > 0 ? 1 - waited[1] / waited[0] : 0.0);
        }
      }
  return 0;
}
