// Fully sharded data parallelism: the bytes a data-parallel rank holds, and the step time,
// for each shard level (optimizer: ZeRO-1, gradients: ZeRO-2, parameters: ZeRO-3) at
// d = 1, 2, 4, 8, beside a formula that names every buffer. The d replicas are stage
// actors of this process (one stage each); the bytes are glibc's allocated bytes
// (mallinfo2), sampled every millisecond during steps 2 .. N: the peak less the bytes
// before the job, and between steps (the lowest sample) likewise.
// Timings are never asserted (docs/performance.md).
//   build/troupe_fsdp_bench [--width W] [--layers L] [--seq S] [--steps N] [--rounds R]
//                           [--only-hybrid 1] [--only-prefetch 1] [--only-speed 1] [--only-memory 1]
// (Then hybrid sharding, parameters sharded in groups of g of 8 replicas, the step time
// of each level on one job, in alternating rounds, and parameters sharded with and
// without the gathers' prefetch on a pipeline of 2 stages of 2 chunks each (interleaved
// 1F1B), and by blocks on one stage; --only-hybrid 1: the hybrid rows alone;
// --only-prefetch 1: the prefetch rows alone; --only-speed 1: the step times alone;
// --only-memory 1: the first table alone. Each level that shards gradients runs by
// chunks and by blocks, parallel.fsdp_unit.)
#include <malloc.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "actors/runtime.hpp"
#include "compute/models/model.hpp"
#include "compute/models/parameters.hpp"
#include "launch/blas_kernels.hpp"

using namespace troupe;

namespace {

std::int64_t allocated() {
  const auto m = mallinfo2();
  return std::int64_t(m.uordblks + m.hblkhd);
}

struct measured {
  double peak_mb = 0, between_mb = 0, step_s = 0;
  double gather_wait_s = 0;  ///< the stages' waits in FSDP all-gathers, per step of steps 2 .. N (all ranks)
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

/// One run: its peak and between-step bytes above the bytes before it, and its median step.
measured run(const job_config& c) {
  malloc_trim(0);
  const auto before = allocated();
  std::atomic<bool> done{false};
  std::atomic<std::int64_t> peak{0};
  std::vector<std::pair<double, std::int64_t>> samples;  // (time, bytes)
  const auto t0 = std::chrono::steady_clock::now();
  std::thread sampler([&] {
    while (!done) {
      const auto b = allocated();
      peak = std::max(peak.load(), b);
      samples.emplace_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), b);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  });
  actor_run_options opts;
  opts.quiet = true;
  const auto r = run_actor_training(c, opts);
  done = true;
  sampler.join();
  if (r.exit_code != 0) {
    std::fprintf(stderr, "run failed: %s\n", r.error.c_str());
    std::exit(1);
  }
  // The window of steps 2 .. N on the job's clock (which starts as the job does, a few
  // milliseconds after t0): the peak in it, and its lowest sample (between steps).
  double from = 1e300, to = 0, gather_wait = 0;
  for (const auto& e : r.events) {
    if (e.step >= 1) from = std::min(from, e.start_us * 1e-6);
    to = std::max(to, e.end_us * 1e-6);
    if (e.step >= 1 && (e.name == "fsdp all-gather" || e.name == "fsdp prefetched all-gather"))
      gather_wait += (e.end_us - e.start_us) * 1e-6;
  }
  std::int64_t high = 0, low = peak;
  for (const auto& [t, b] : samples)
    if (t >= from && t <= to) high = std::max(high, b), low = std::min(low, b);
  measured m;
  m.peak_mb = (high - before) / 1e6;
  m.between_mb = (low - before) / 1e6;
  std::vector<double> steps(r.step_seconds.begin() + 1, r.step_seconds.end());  // (the first warms up)
  m.step_s = median(steps);
  m.gather_wait_s = steps.empty() ? 0 : gather_wait / double(steps.size());
  return m;
}

/// A prefetch variant: its shard level and unit, with or without the prefetch.
struct prefetch_variant {
  const char* name;
  const char* shard;
  const char* unit;
  bool prefetch;
};

/// `variants` of `layout`'s job (its first: the reference) in alternating rounds: the
/// median over rounds of each run's median step, its ratio to the reference's, the
/// gathers' wait per step over the `ranks` ranks and the peak bytes per rank.
template <class Layout>
int prefetch_table(const job_config& base, int rounds, int ranks, const std::vector<prefetch_variant>& variants,
                   Layout layout) {
  std::printf("| run | step s | ratio to optimizer | all-gather wait per step (%d ranks) | peak per rank MB |\n"
              "| --- | --- | --- | --- | --- |\n",
              ranks);
  std::map<std::string, std::vector<double>> times, peaks, waits;
  for (int r = 0; r < std::max(rounds, 3); ++r)
    for (const auto& v : variants) {
      auto c = base;
      layout(c);
      c.shard = v.shard;
      c.fsdp_unit = v.unit;
      c.fsdp_prefetch = v.prefetch;
      const auto m = run(c);
      times[v.name].push_back(m.step_s);
      peaks[v.name].push_back(m.peak_mb / ranks);
      waits[v.name].push_back(m.gather_wait_s);
    }
  const double ref = median(times[variants.front().name]);
  for (const auto& v : variants)
    std::printf("| %s | %.3f | %.3f | %.1f ms | %.1f |\n", v.name, median(times[v.name]), median(times[v.name]) / ref,
                median(waits[v.name]) * 1e3, median(peaks[v.name]));
  return 0;
}

/// Parameters sharded, with and without the gathers' prefetch (parallel.fsdp_prefetch),
/// beside optimizer, by chunks: pipeline 2 x d 2, 2 chunks per stage (interleaved 1F1B),
/// 4 micro-batches per replica (the prefetched chunk is held beside the current one); by
/// blocks: d = 2, one stage of all the layers, 4 micro-batches per replica.
int prefetch_rows(const job_config& base, int rounds) {
  std::printf("\nprefetch by chunks: parameters sharded, pipeline 2 x d 2, 2 chunks per stage (interleaved-1f1b), 4 "
              "micro-batches per replica, %d alternating rounds (median of each run's median step)\n",
              std::max(rounds, 3));
  prefetch_table(base, rounds, 4,
                 {{"optimizer", "optimizer", "chunk", true},
                  {"parameters, prefetch", "parameters", "chunk", true},
                  {"parameters, no prefetch", "parameters", "chunk", false}},
                 [](job_config& c) {
                   c.pipeline = 2;
                   c.data_parallel = 2;
                   c.chunks = 2;
                   c.schedule = "interleaved-1f1b";
                   c.layers = std::max(4, c.layers);
                   c.microbatches = 4;
                   c.global_batch = 8;
                 });
  std::printf("\nprefetch by blocks: parameters sharded, d = 2, one stage of %d blocks, 4 micro-batches per replica, "
              "%d alternating rounds (median of each run's median step)\n",
              base.layers, std::max(rounds, 3));
  return prefetch_table(base, rounds, 2,
                        {{"optimizer", "optimizer", "block", true},
                         {"parameters by block, prefetch", "parameters", "block", true},
                         {"parameters by block, no prefetch", "parameters", "block", false}},
                        [](job_config& c) {
                          c.data_parallel = 2;
                          c.microbatches = 4;
                          c.global_batch = 8;
                        });
}

}  // namespace

int main(int argc, char** argv) {
  int width = 512, layers = 4, seq = 256, steps = 6, rounds = 1, only_hybrid = 0, only_prefetch = 0,
      only_speed = 0, only_memory = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    const int v = std::atoi(argv[i + 1]);
    if (a == "--width") width = v;
    else if (a == "--layers") layers = v;
    else if (a == "--seq") seq = v;
    else if (a == "--steps") steps = v;
    else if (a == "--rounds") rounds = v;
    else if (a == "--only-hybrid") only_hybrid = v;
    else if (a == "--only-prefetch") only_prefetch = v;
    else if (a == "--only-speed") only_speed = v;
    else if (a == "--only-memory") only_memory = v;
  }
  run_with_blas_kernels(argv);  // as the troupe command does
  auto base = job_config::defaults_for("llama-tiny");
  base.runtime = "actors";
  base.device = "cpu";
  base.d_model = width;
  base.heads = 8;
  base.kv_heads = 4;
  base.layers = layers;
  base.seq_len = seq;
  base.steps = steps;
  base.threads = 1;
  base.microbatches = 1;
  base.eval_interval = 0;
  base.checkpoint_async = false;
  base.eval_tokens = seq;  // (the run's end evaluates: one window per forward, outside the window measured)
  const auto spec = base.model();
  std::int64_t P = 0, rest = 0;  // (rest: the embeddings, final norm and output layer)
  for (const auto& [name, t] : initial_state(spec, 1)) {
    P += t.numel();
    if (name.rfind("model.layers.", 0) != 0) rest += t.numel();
  }
  const double MB = 1e6, p4 = 4.0 * P / MB;  // fp32 bytes of the whole model, MB
  const double r4 = 4.0 * rest / MB, b4 = (p4 - r4) / layers;  // the rest's, and a block's
  std::printf("llama shape: width %d, %d layers, seq %d, %lld parameters (%.1f MB fp32); 1 sequence per rank "
              "per step, %d steps\n",
              width, layers, seq, static_cast<long long>(P), p4, steps);
  if (only_prefetch) return prefetch_rows(base, rounds);
  if (!only_speed && !only_hybrid)
    std::printf("per rank, MB: measured peak and between steps ((process bytes - bytes before) / d), and the "
                "formula's model state (W: the whole model's fp32 bytes)\n"
                "| shard | unit | d | peak | between steps | formula between | formula peak (state + working set) | "
                "step s |\n| --- | --- | --- | --- | --- | --- | --- | --- |\n");
  const std::pair<const char*, const char*> levels_units[] = {
      {"optimizer", "block"}, {"gradients", "chunk"}, {"parameters", "chunk"}, {"gradients", "block"},
      {"parameters", "block"}};
  for (const auto& [level, unit] : levels_units) {
    if (only_hybrid || only_speed) break;
    const bool blocks = std::string(unit) == "block" && std::string(level) != "optimizer";
    for (int d : {1, 2, 4, 8}) {
      auto c = base;
      c.data_parallel = d;
      c.global_batch = d;
      c.shard = level;
      c.fsdp_unit = unit;
      std::vector<measured> ms;
      for (int r = 0; r < rounds; ++r) ms.push_back(run(c));
      measured m = ms.front();
      for (const auto& x : ms) m.step_s = std::min(m.step_s, x.step_s);
      // The formula (fp32, W = 4 P bytes). Every rank: its shard's fp32 main parameters
      // and two moments (3 W / d; from its update to the next step's begin also the state
      // before it, for in-place retries: 3 W / d more, counted in the peak) and its reduced
      // gradient pieces (W / d).
      // optimizer: the stage's parameters and gradients (2 W) and the shard's gathered
      // buffer (W). gradients: the parameters and gathered buffer (2 W), the stage's
      // gradient pieces (W / d); the gradient buffer only in a backward (W working).
      // parameters: the stage's gradient pieces (W / d); its parameter pieces are the
      // shard's own; the parameters and gradients of the chunk its ops run on (2 W
      // working, kept while the next op is on the same chunk).
      // By blocks (R: the rest's bytes, B: a block's): the rest's gradients (and
      // parameters) for the run, and of the blocks one block's gradients (R + B working
      // with gradients), and the parameters of the block computing and of the next one,
      // prefetched (2 R + 3 B with parameters).
      // (The job's initial parameters are the actors' alone once they have started:
      // runtime_context::take_init.)
      const double shard = 4 * p4 / d;
      double between = 0, working = 3 * p4 / d;  // (the update's second bank)
      if (std::string(level) == "optimizer") between = 3 * p4 + shard;
      if (std::string(level) == "gradients") between = 2 * p4 + shard + p4 / d, working += blocks ? r4 + b4 : p4;
      if (std::string(level) == "parameters") between = shard + p4 / d, working += blocks ? 2 * r4 + 3 * b4 : 2 * p4;
      std::printf("| %s | %s | %d | %.1f | %.1f | %.1f | %.1f | %.3f |\n", level,
                  std::string(level) == "optimizer" ? "-" : unit, d, m.peak_mb / d, m.between_mb / d,
                  between, between + working, m.step_s);
      std::fflush(stdout);
    }
  }
  if (only_memory) return 0;
  // Hybrid sharding: parameters sharded within groups of g of the 8 replicas, replicated
  // across them: a rank's model state is that of d = g (every 1/d of the formula is 1/g).
  if (!only_speed)
    std::printf("\nhybrid sharding, parameters, d = 8 replicas in shard groups of g (per rank, MB)\n"
                "| g | peak | between steps | formula between | formula peak | step s |\n"
                "| --- | --- | --- | --- | --- | --- |\n");
  for (int g : {1, 2, 4, 8}) {
    if (only_speed) break;
    auto c = base;
    c.data_parallel = 8;
    c.global_batch = 8;
    c.shard = "parameters";
    c.shard_group = g;
    const auto m = run(c);
    const double between = 5 * p4 / g, working = 2 * r4 + 3 * b4 + 3 * p4 / g;  // (by blocks)
    std::printf("| %d | %.1f | %.1f | %.1f | %.1f | %.3f |\n", g, m.peak_mb / 8, m.between_mb / 8, between,
                between + working, m.step_s);
    std::fflush(stdout);
  }
  if (only_hybrid) return 0;
  // Speed: the same job (d = 2, 4 micro-batches of 1 sequence per replica) at each level,
  // in alternating rounds; the median over rounds of each run's median step.
  std::printf("\nstep time, d = 2, 4 micro-batches per replica, %d alternating rounds (median of each run's "
              "median step; ratio to optimizer)\n| shard | step s | ratio |\n| --- | --- | --- |\n",
              std::max(rounds, 3));
  std::map<std::string, std::vector<double>> times;
  for (int r = 0; r < std::max(rounds, 3); ++r)
    for (const auto& [level, unit] : levels_units) {
      auto c = base;
      c.data_parallel = 2;
      c.microbatches = 4;
      c.global_batch = 8;
      c.shard = level;
      c.fsdp_unit = unit;
      times[std::string(level) + " by " + unit].push_back(run(c).step_s);
    }
  const double ref = median(times["optimizer by block"]);
  for (const auto& [level, unit] : levels_units) {
    const auto key = std::string(level) + " by " + unit;
    std::printf("| %s | %.3f | %.3f |\n", std::string(level) == "optimizer" ? level : key.c_str(), median(times[key]),
                median(times[key]) / ref);
  }
  if (only_speed) return 0;
  return prefetch_rows(base, rounds);
}
