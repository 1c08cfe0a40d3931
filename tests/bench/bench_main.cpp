// Troupe benchmarks (Google Benchmark). Run them with tests/bench/run, which also runs
// the Python reference and prints the ratios recorded in docs/performance.md.
//
//   BM_Sgemm/blas:openblas    LibTorch's matmul through libblas.so.3 (OpenBLAS after set-up)
//   BM_Sgemm/blas:reference   Netlib's reference BLAS, loaded directly, same sizes
//   BM_MakeSchedule           generation of 128 stages x 1024 micro-batches (x 4 chunks)
//   BM_TrainStep/threads:T    one gpt-tiny step of the single-process loop
//   BM_Generate/W/bytes:N/kv_cache:C
//                             `troupe generate` of N bytes after a 1-byte prompt (greedy,
//                             2 threads) with workload W's shape, key/value cache on or off
#include <benchmark/benchmark.h>
#include <dlfcn.h>
#include <torch/torch.h>

#include "launch/blas_kernels.hpp"
#include "compute/trainer/generate.hpp"
#include "compute/schedule/schedule.hpp"
#include "compute/trainer/local_trainer.hpp"

namespace {

constexpr int kGemm = 512;  ///< square sgemm size

using sgemm_fn = void (*)(const char*, const char*, const int*, const int*, const int*, const float*,
                          const float*, const int*, const float*, const int*, const float*, float*, const int*);

void set_flops(benchmark::State& state, double flops_per_iter) {
  state.counters["GFLOP/s"] = benchmark::Counter(flops_per_iter * 1e-9 * state.iterations(), benchmark::Counter::kIsRate);
}

void BM_SgemmLibtorch(benchmark::State& state) {
  torch::set_num_threads(1);
  auto a = torch::randn({kGemm, kGemm}), b = torch::randn({kGemm, kGemm});
  for (auto _ : state) benchmark::DoNotOptimize(torch::mm(a, b));
  set_flops(state, 2.0 * kGemm * kGemm * kGemm);
}
BENCHMARK(BM_SgemmLibtorch)->Name("BM_Sgemm/blas:libtorch-1thread")->Unit(benchmark::kMillisecond);

void BM_SgemmReference(benchmark::State& state) {
  void* lib = dlopen("/usr/lib/x86_64-linux-gnu/blas/libblas.so.3", RTLD_NOW | RTLD_LOCAL);
  auto sgemm = lib ? reinterpret_cast<sgemm_fn>(dlsym(lib, "sgemm_")) : nullptr;
  if (!sgemm) {
    state.SkipWithError("reference BLAS (package libblas3) not installed");
    return;
  }
  std::vector<float> a(kGemm * kGemm, 1.0f), b(kGemm * kGemm, 0.5f), c(kGemm * kGemm);
  const int n = kGemm;
  const float one = 1.0f, zero = 0.0f;
  for (auto _ : state) {
    sgemm("N", "N", &n, &n, &n, &one, a.data(), &n, b.data(), &n, &zero, c.data(), &n);
    benchmark::DoNotOptimize(c.data());
  }
  set_flops(state, 2.0 * kGemm * kGemm * kGemm);
}
BENCHMARK(BM_SgemmReference)->Name("BM_Sgemm/blas:reference")->Unit(benchmark::kMillisecond);

void BM_MakeSchedule(benchmark::State& state) {
  const auto kind = static_cast<troupe::schedule_kind>(state.range(0));
  const int chunks = kind == troupe::schedule_kind::interleaved ? 4 : 1;
  std::size_t ops = 0;
  for (auto _ : state) {
    auto s = troupe::make_schedule(kind, 128, 1024, chunks);
    ops = 0;
    for (const auto& r : s.ranks) ops += r.size();
    benchmark::DoNotOptimize(s);
  }
  state.counters["ops"] = double(ops);
  state.SetLabel(troupe::to_string(kind) + " 128x1024x" + std::to_string(chunks));
}
BENCHMARK(BM_MakeSchedule)
    ->Arg(int(troupe::schedule_kind::one_f_one_b))
    ->Arg(int(troupe::schedule_kind::interleaved))
    ->Unit(benchmark::kMillisecond);

/// Model FLOPs of one gpt-tiny step: 6 x (parameters in matmuls) x tokens + attention
/// (12 x layers x d_model x seq_len per token, forward and backward).
double gpt_step_flops(const troupe::job_config& c) {
  const auto spec = c.model();
  double n = 0;
  for (const auto& [name, t] : troupe::initial_state(spec, 1))
    if (name != "wpe.weight") n += double(t.numel());
  const double tokens = double(c.global_batch) * spec.decoder.seq_len;
  return 6.0 * n * tokens + 12.0 * spec.decoder.n_layer * spec.decoder.d_model * spec.decoder.seq_len * tokens;
}

void BM_TrainStep(benchmark::State& state) {
  const int threads = int(state.range(0));
  torch::set_num_threads(threads);
  auto c = troupe::job_config::defaults_for("gpt-tiny");
  c.steps = 1000000;
  troupe::local_trainer t(c);
  t.step();  // warm-up
  for (auto _ : state) benchmark::DoNotOptimize(t.step());
  const double tokens = double(c.global_batch) * c.model().decoder.seq_len;
  state.counters["tokens/s"] = benchmark::Counter(tokens * state.iterations(), benchmark::Counter::kIsRate);
  set_flops(state, gpt_step_flops(c));
}
BENCHMARK(BM_TrainStep)->ArgName("threads")->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->MinTime(5.0)->UseRealTime();

void BM_Generate(benchmark::State& state) {
  torch::set_num_threads(2);
  const auto spec = troupe::job_config::defaults_for(state.range(0) ? "gpt-small" : "gpt-tiny").model();
  const auto weights = troupe::initial_state(spec, 1);
  troupe::sampling_options s;
  s.tokens = int(state.range(1));
  s.kv_cache = state.range(2) != 0;
  s.temperature = 0;
  for (auto _ : state) benchmark::DoNotOptimize(troupe::generate(spec, weights, "T", s));
  state.counters["bytes/s"] = benchmark::Counter(double(s.tokens) * state.iterations(), benchmark::Counter::kIsRate);
  state.SetLabel(spec.name());
}
BENCHMARK(BM_Generate)
    ->ArgNames({"gpt-small", "bytes", "kv_cache"})
    ->Args({0, 63, 1})
    ->Args({0, 63, 0})
    ->Args({0, 127, 1})  // up to the whole context
    ->Args({0, 127, 0})
    ->Args({1, 128, 1})
    ->Args({1, 128, 0})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace

int main(int argc, char** argv) {
  troupe::run_with_blas_kernels(argv);  // as the troupe command does
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
