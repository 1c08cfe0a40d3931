// Actor-runtime benchmarks (a small driver; tests/bench/run runs it). Every figure is a
// ratio or difference against a reference measured in the same run:
//   overhead     p=1 d=1 actor step vs the plain single-process loop, same threads
//   pipelining   p=2, 1 intra-op thread per stage vs p=1 with 1 thread; measured bubble
//                vs the simulator's for the measured forward/backward costs
//   messaging    runtime cost per micro-batch: a one-layer gpt-tiny of width 32 with
//                1-sample micro-batches (little compute), 64 vs 16 micro-batches per step,
//                actors vs plain loop
//   memory       bytes of fp32 main params + AdamW moments per optimizer shard, D = 1, 2, 4
//   recompute    activation recomputation (train.recompute = selective, full): bytes one
//                micro-batch holds for its backward with each and without (gpt-tiny,
//                gpt-small), and the step time with each vs without (p=1 d=1, 1 thread)
//   bf16 params  bf16 stages: bytes of the parameter buffer and bytes one bf16 micro-batch
//                holds for its backward, with fp32 parameters holding the bf16 values (the
//                layout of an fp32 buffer of bf16 values) vs bf16 parameters (gpt-tiny, gpt-small)
//   zero-bubble  p=2, 1 thread per stage: zero-bubble (ZB-H1), dataflow and dataflow
//                with split_backward vs 1f1b step time and measured bubble, and the
//                simulator's bubbles for the measured F, B, W
//                (`troupe_runtime_bench STEPS zero-bubble` runs only this part)
// `troupe_runtime_bench STEPS overhead` runs only the overhead and messaging parts.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <torch/torch.h>

#include "actors/runtime.hpp"
#include "launch/blas_kernels.hpp"
#include "compute/optim/grad_buffer.hpp"
#include "compute/runtime/host_memory.hpp"
#include "compute/trainer/local_trainer.hpp"
#include "tests/support/held_bytes.hpp"

namespace {

using namespace troupe;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

/// Median step time of the plain loop (first step dropped: warm-up). It runs on a thread
/// of its own: its OpenMP team goes with the thread and does not linger beside the actors'.
double plain_step_seconds(job_config c, int steps) {
  std::vector<double> times;
  std::thread worker([&] {
    c.runtime = "local";
    torch::set_num_threads(c.threads);
    local_trainer t(c);
    for (int i = 0; i < steps; ++i) times.push_back(t.step().seconds);
  });
  worker.join();
  times.erase(times.begin());
  return median(times);
}

struct actor_figures {
  double step_s, bubble;
  std::vector<trace_event> events;
};

actor_figures actor_step_seconds(job_config c, int steps) {
  c.runtime = "actors";
  c.steps = std::max(c.steps, steps);
  c.eval_interval = 0;
  actor_run_options o;
  o.quiet = true;
  auto cfg = c;
  cfg.steps = steps;
  cfg.lr = c.lr;
  auto r = run_actor_training(cfg, o);
  if (r.exit_code != 0) {
    std::fprintf(stderr, "actor run failed: %s\n", r.error.c_str());
    std::exit(1);
  }
  r.step_seconds.erase(r.step_seconds.begin());
  r.bubbles.erase(r.bubbles.begin());
  return {median(r.step_seconds), median(r.bubbles), r.events};
}

/// Median over steps (the first dropped) of the time stage 0 of replica 0 waited between
/// two of its compute ops, summed over the step and divided by the micro-batches (us).
double median_gap_per_microbatch(const std::vector<trace_event>& events, int microbatches) {
  std::map<std::int64_t, std::vector<std::pair<double, double>>> by_step;
  for (const auto& e : events)
    if ((e.name == "F" || e.name == "B") && e.replica == 0 && e.stage == 0)
      by_step[e.step].emplace_back(e.start_us, e.end_us);
  std::vector<double> per_step;
  for (auto& [step, ops] : by_step) {
    if (step == by_step.begin()->first) continue;  // warm-up
    std::sort(ops.begin(), ops.end());
    double gap = 0;
    for (std::size_t i = 1; i < ops.size(); ++i) gap += std::max(0.0, ops[i].first - ops[i - 1].second);
    per_step.push_back(gap / microbatches);
  }
  return median(per_step);
}

/// Mean duration (ms) of the compute events named `name`.
double mean_ms(const std::vector<trace_event>& events, const char* name) {
  double sum = 0;
  int n = 0;
  for (const auto& e : events)
    if (e.name == name) sum += e.end_us - e.start_us, ++n;
  return n ? sum / n / 1e3 : 0;
}

/// The backward of one micro-batch alone on this thread (all of gpt-tiny, micro-batch 4,
/// 1 thread): the plain backward against B then W (ms, median of
/// `reps` after a warm-up).
void split_backward_row(int reps) {
  torch::set_num_threads(1);
  const auto spec = model_spec::gpt_tiny();
  const auto init = initial_state(spec, 1);
  auto slice = make_slice(spec, partition_layers(spec.n_layers(), 1)[0], init);
  const auto input = torch::randint(256, {4, spec.decoder.seq_len}, torch::kInt64);
  const auto target = torch::randint(256, {4, spec.decoder.seq_len}, torch::kInt64);
  using clock = std::chrono::steady_clock;
  const auto ms = [](clock::time_point a, clock::time_point b) { return std::chrono::duration<double, std::milli>(b - a).count(); };
  std::vector<double> plain, b, w;
  for (int i = 0; i <= reps; ++i) {
    auto loss = slice->loss(slice->forward(input), target);
    auto t0 = clock::now();
    loss.backward();
    if (i) plain.push_back(ms(t0, clock::now()));
    weight_grad_store store;
    slice->defer_weight_grads(&store);
    loss = slice->loss(slice->forward(input), target);
    slice->defer_weight_grads(nullptr);
    t0 = clock::now();
    loss.backward();
    const auto t1 = clock::now();
    store.apply();
    if (i) b.push_back(ms(t0, t1)), w.push_back(ms(t1, clock::now()));
  }
  std::printf("| backward alone (gpt-tiny, one slice of 8 blocks, micro-batch 4, 1 thread): plain / B + W "
              "| %.1f / %.1f + %.1f ms (%.2fx) |\n",
              median(plain), median(b), median(w), (median(b) + median(w)) / median(plain));
}

/// Zero-bubble vs 1f1b: p = 2, 1 thread per stage, 8 and 4 micro-batches; fastest of 3
/// alternating rounds each.
void zero_bubble_rows(job_config c, int steps) {
  split_backward_row(20);
  c.threads = 1;
  c.pipeline = 2;
  struct variant {
    const char* name;
    const char* schedule;
    bool split;
    actor_figures best{1e9, 0, {}};
  };
  for (int m : {8, 4}) {
    c.microbatches = m;
    std::vector<variant> runs{{"1f1b", "1f1b", false},
                              {"zero-bubble", "zero-bubble", false},
                              {"dataflow", "dataflow", false},
                              {"dataflow split", "dataflow", true}};
    for (int round = 0; round < 3; ++round)
      for (auto& r : runs) {
        c.schedule = r.schedule;
        c.split_backward = r.split;
        auto a = actor_step_seconds(c, steps);
        if (a.step_s < r.best.step_s) r.best = std::move(a);
      }
    const auto& one = runs[0].best;
    const auto& zb = runs[1].best;
    const double f = mean_ms(one.events, "F"), b = mean_ms(one.events, "B");
    const double zf = mean_ms(zb.events, "F"), zb_b = mean_ms(zb.events, "B"), zw = mean_ms(zb.events, "W");
    const auto sim_one = simulate(make_schedule(schedule_kind::one_f_one_b, 2, m), f, b);
    const auto sim_zb = simulate(make_schedule(schedule_kind::zero_bubble, 2, m), zf, zb_b + zw, zw);
    std::string names, steps_ms, ratios, bubbles;
    for (const auto& r : runs) {
      const auto sep = names.empty() ? "" : " / ";
      names += sep + std::string(r.name);
      steps_ms += sep + fmt::format("{:.1f}", r.best.step_s * 1e3);
      ratios += sep + fmt::format("{:.3f}x", one.step_s / r.best.step_s);
      bubbles += sep + fmt::format("{:.3f}", r.best.bubble);
    }
    std::printf("| gpt-tiny p=2, %d micro-batches, 1 thread per stage: step %s | %s ms (1f1b's / each: %s) |\n", m,
                names.c_str(), steps_ms.c_str(), ratios.c_str());
    std::printf("| bubble measured, %s (simulated 1f1b %.3f, zero-bubble %.3f) | %s |\n", names.c_str(),
                sim_one.bubble, sim_zb.bubble, bubbles.c_str());
    std::printf("| mean op, 1f1b F, B / zero-bubble F, B, W | %.1f, %.1f / %.1f, %.1f, %.1f ms (B + W = %.2fx 1f1b's "
                "B) |\n",
                f, b, zf, zb_b, zw, (zb_b + zw) / b);
  }
}

}  // namespace

int main(int argc, char** argv) {
  troupe::run_with_blas_kernels(argv);  // as the troupe command does
  const int steps = argc > 1 ? std::atoi(argv[1]) : 12;
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // each row as it is measured (a run cut short keeps them)
  troupe::tune_host_allocator();  // as the troupe command does
  spdlog::set_level(spdlog::level::warn);
  auto gpt = job_config::defaults_for("gpt-tiny");
  gpt.steps = 200;

  std::printf("| measure | value |\n| --- | --- |\n");
  if (argc > 2 && std::string(argv[2]) == "zero-bubble") {
    zero_bubble_rows(gpt, steps);
    return 0;
  }
  // Overhead: p = 1, d = 1, 2 threads, both runtimes, in 8 rounds of a pair (plain loop
  // first in even rounds, actors first in odd ones). The VM's speed drifts by several per
  // cent over minutes, less within a pair: besides the fastest of each, the median of the
  // pairs' ratios.
  {
    auto c = gpt;
    c.threads = 2;
    double plain = 1e9, actors = 1e9;
    std::vector<double> ratios;
    for (int round = 0; round < 8; ++round) {
      double p = round % 2 == 0 ? plain_step_seconds(c, steps) : 0;
      const double a = actor_step_seconds(c, steps).step_s;
      if (round % 2 == 1) p = plain_step_seconds(c, steps);
      plain = std::min(plain, p);
      actors = std::min(actors, a);
      ratios.push_back(a / p);
    }
    std::printf("| gpt-tiny step, p=1 d=1, 2 threads: plain loop / actors, fastest of 8 rounds; median of the rounds' "
                "actors / plain | %.1f ms / %.1f ms (actors %+.1f %%); %+.1f %% |\n",
                plain * 1e3, actors * 1e3, 100 * (actors / plain - 1), 100 * (median(ratios) - 1));
  }
  // `troupe_runtime_bench STEPS overhead`: the overhead and messaging parts only (an
  // A/B of something around the runtime, e.g. LD_PRELOAD of another malloc).
  const bool only_overhead = argc > 2 && std::string(argv[2]) == "overhead";
  // Pipelining: p = 2 with 1 thread per stage vs p = 1 with 1 thread.
  if (!only_overhead) {
    auto c = gpt;
    c.threads = 1;
    const auto one = actor_step_seconds(c, steps);
    c.pipeline = 2;
    const auto two = actor_step_seconds(c, steps);
    // Simulator with this run's measured mean forward and backward costs.
    const double f = mean_ms(two.events, "F"), b = mean_ms(two.events, "B");
    const auto sim = simulate(make_schedule(schedule_kind::one_f_one_b, 2, c.microbatches), f, b);
    std::printf("| gpt-tiny, 1 thread per stage: p=1 / p=2 (1f1b, 8 micro-batches) | %.0f / %.0f tokens/s = %.2fx |\n",
                4096 / one.step_s, 4096 / two.step_s, one.step_s / two.step_s);
    std::printf("| p=2 bubble: measured / simulated (measured F %.1f ms, B %.1f ms) | %.3f / %.3f |\n", f, b,
                two.bubble, sim.bubble);
  }
  // Messaging: a one-layer gpt-tiny of width 32 over 16 tokens (the callgrind script's),
  // 1-sample micro-batches, 1 thread, p=1: about 0.56 ms per micro-batch, nearly all of
  // it LibTorch's per-op cost (fmnist-mlp's 0.7 ms: this VM's drift of a few per cent
  // moves the figure by tens of us, hence the rounds' medians). The cost of one more
  // micro-batch is (T(64) - T(16)) / 48 per runtime (per-step costs cancel); the
  // runtime's overhead per micro-batch is the actors' cost minus the plain loop's: from
  // the fastest run of each of the four over 8 rounds, and the median of the rounds' own.
  {
    auto c = job_config::defaults_for("gpt-tiny");
    c.layers = 1;
    c.d_model = 32;
    c.heads = 2;
    c.seq_len = 16;
    c.threads = 1;
    c.steps = 200;
    double plain[2] = {1e9, 1e9}, actors[2] = {1e9, 1e9}, gaps = 1e9;
    const int counts[2] = {16, 64};
    std::vector<double> differences;  // per round: the actors' cost per micro-batch minus the plain loop's
    for (int round = 0; round < 8; ++round) {
      double p[2], a[2];
      for (int i = 0; i < 2; ++i) {
        c.global_batch = c.microbatches = counts[i];
        p[i] = plain_step_seconds(c, 3 * steps);
        const auto run = actor_step_seconds(c, 3 * steps);
        a[i] = run.step_s;
        plain[i] = std::min(plain[i], p[i]);
        actors[i] = std::min(actors[i], a[i]);
        if (i == 1) gaps = std::min(gaps, median_gap_per_microbatch(run.events, counts[i]));
      }
      differences.push_back(((a[1] - a[0]) - (p[1] - p[0])) / 48);
    }
    const double per_plain = (plain[1] - plain[0]) / 48, per_actors = (actors[1] - actors[0]) / 48;
    std::printf("| per micro-batch (gpt-tiny of 1 layer, width 32, 16 tokens, 1 sample, p=1): plain loop / actors / "
                "difference, fastest runs; median of the rounds' differences | %.1f / %.1f / %.1f us; %.1f us |\n",
                per_plain * 1e6, per_actors * 1e6, (per_actors - per_plain) * 1e6, median(differences) * 1e6);
    std::printf("| per micro-batch: the stage's wait between its ops (message + scheduling; trace gaps, 64 "
                "micro-batches) | %.1f us |\n",
                gaps);
  }
  if (only_overhead) return 0;
  // Memory per optimizer shard: fp32 main parameters + two AdamW moments.
  {
    const auto spec = model_spec::gpt_tiny();
    const auto init = initial_state(spec, 1);
    for (int d : {1, 2, 4}) {
      auto slice = make_slice(spec, partition_layers(8, 1)[0], init, d);
      const auto range = shard_ranges(slice->flat_params().numel(), d)[0];
      std::printf("| optimizer shard state, gpt-tiny p=1, D=%d | %.2f MB (%lld elements x 3 x 4 B) |\n", d,
                  range.size() * 12 / 1e6, static_cast<long long>(range.size()));
    }
  }
  // Memory (malloc's statistics count the main thread's allocations): the bytes a
  // micro-batch's forward and loss hold until its backward, with and without activation
  // recomputation; and bf16 stages' parameters: fp32 ones holding bf16 values (autocast
  // casts each weight per micro-batch and the graph keeps the copy) vs bf16 ones.
  {
    struct model_case {
      const char* name;
      model_spec spec;
      std::int64_t mbs;
    };
    for (const auto& m : {model_case{"gpt-tiny", model_spec::gpt_tiny(), 4},
                          model_case{"gpt-small", model_spec::gpt_small(), 1}}) {
      auto init = initial_state(m.spec, 1);
      const auto whole = partition_layers(m.spec.n_layers(), 1)[0];
      const auto seq = m.spec.decoder.seq_len;
      const auto input = torch::randint(256, {m.mbs, seq}, torch::kInt64);
      const auto target = torch::randint(256, {m.mbs, seq}, torch::kInt64);
      {
        auto slice = make_slice(m.spec, whole, init);
        test::bytes_held_for_backward(*slice, input, target);  // one-off buffers
        const auto plain = test::bytes_held_for_backward(*slice, input, target);
        slice->set_recompute(recompute_mode::selective);
        const auto selective = test::bytes_held_for_backward(*slice, input, target);
        slice->set_recompute(recompute_mode::full);
        const auto recomputed = test::bytes_held_for_backward(*slice, input, target);
        std::printf("| %s, micro-batch %lld x %lld tokens: bytes held for the backward, none / selective / full "
                    "recompute | %.1f / %.1f / %.1f MB (%.1fx / %.1fx less) |\n",
                    m.name, static_cast<long long>(m.mbs), static_cast<long long>(seq), plain / 1e6, selective / 1e6,
                    recomputed / 1e6, double(plain) / double(selective), double(plain) / double(recomputed));
      }
      for (auto& [name, t] : init) t = t.to(torch::kBFloat16).to(torch::kFloat32);
      auto held = [&](model_slice& slice) { return test::bytes_held_for_backward(slice, input, target, torch::kBFloat16); };
      auto f = make_slice(m.spec, whole, init, 1, torch::kCPU, torch::kFloat32);
      auto b = make_slice(m.spec, whole, init, 1, torch::kCPU, torch::kBFloat16);
      held(*f);  // one-off buffers
      held(*b);
      const auto f_held = held(*f), b_held = held(*b);
      std::int64_t copies = 0;  // the bf16 slice's fp32 copies (layer norms, embeddings)
      for (const auto& p : b->parameters())
        if (p.scalar_type() == torch::kFloat32) copies += p.nbytes();
      const auto b_bytes = b->flat_params().nbytes() + copies;
      std::printf("| %s, bf16: parameters, fp32 / bf16 parameters (bf16 buffer + fp32 copies) | %.1f / %.1f MB "
                  "(%.1f + %.1f; %.2fx less) |\n",
                  m.name, f->flat_params().nbytes() / 1e6, b_bytes / 1e6, b->flat_params().nbytes() / 1e6, copies / 1e6,
                  double(f->flat_params().nbytes()) / double(b_bytes));
      std::printf("| %s, bf16 micro-batch %lld x %lld tokens: bytes held for the backward, fp32 / bf16 parameters | "
                  "%.1f / %.1f MB (%.1f MB less) |\n",
                  m.name, static_cast<long long>(m.mbs), static_cast<long long>(seq), f_held / 1e6, b_held / 1e6,
                  (f_held - b_held) / 1e6);
    }
  }
  // Time: p = 1, d = 1, 1 thread, fastest of 3 alternating rounds. One more forward per
  // micro-batch: about (F + F + B) / (F + B), 1.33x for B = 2F.
  {
    auto c = gpt;
    c.threads = 1;
    double plain = 1e9, full = 1e9, selective = 1e9;
    for (int round = 0; round < 3; ++round) {
      c.recompute = "none";
      plain = std::min(plain, actor_step_seconds(c, steps).step_s);
      c.recompute = "selective";
      selective = std::min(selective, actor_step_seconds(c, steps).step_s);
      c.recompute = "full";
      full = std::min(full, actor_step_seconds(c, steps).step_s);
    }
    std::printf("| gpt-tiny step, p=1 d=1, 1 thread: none / selective / full recompute | %.1f / %.1f / %.1f ms "
                "(%.2fx / %.2fx) |\n",
                plain * 1e3, selective * 1e3, full * 1e3, selective / plain, full / plain);
  }
  zero_bubble_rows(gpt, steps);
  return 0;
}
