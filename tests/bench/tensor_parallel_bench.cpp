// Tensor-parallel benchmark (tests/bench/tensor_parallel runs it): the local loop with
// tensor parallelism against the unsplit loop in the same run, at the same number of
// cores (the T ranks share them: 1 intra-op thread each with T = 2 on 2 cores):
//   traffic  elements each kind of collective moved per step, summed over the ranks,
//            against Megatron's count: per layer and micro-batch 2 all-reduces forward and
//            2 backward of b*s*h elements (the embedding's forward and the output layer's
//            f backward add one each, the vocab-parallel cross-entropy 2*b*s and an
//            all-gather of the row maxima); with sequence parallelism the same as
//            all-gathers and reduce-scatters; and the bytes a ring moves for them
//   time     step time with T = 2 (and sequence parallelism) against T = 1, and the share
//            of the ranks' time spent in collectives
//   actors   the same in the actor runtime (T stage actors, in-process groups): the
//            collectives counted from the trace's "tp ..." events, the step times, and
//            the share of the stage actors' time in them
// Prints the table recorded in docs/performance.md; nothing is asserted.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include "actors/runtime.hpp"
#include "actors/tp_groups.hpp"
#include "launch/blas_kernels.hpp"
#include "compute/trainer/local_trainer.hpp"

namespace {

using namespace troupe;

struct measured {
  double step_seconds = 0;  ///< median over the timed steps
  double all_reduce = 0, all_gather = 0, reduce_scatter = 0, ring_bytes = 0, wait_seconds = 0;  ///< per step
};

measured run(job_config c, int steps) {
  auto traffic = std::make_shared<collective_traffic>();
  local_trainer t(c, std::nullopt, [traffic](int size) { return counted_in_process_groups(size, traffic); });
  t.step();  // warm-up, not counted
  const auto zero = [&] {
    traffic->all_reduce = traffic->all_gather = traffic->reduce_scatter = traffic->calls = traffic->wait_ns = 0;
  };
  zero();
  std::vector<double> times;
  for (int i = 0; i < steps; ++i) times.push_back(t.step().seconds);
  std::sort(times.begin(), times.end());
  measured m;
  m.step_seconds = times[times.size() / 2];
  m.all_reduce = double(traffic->all_reduce) / steps;
  m.all_gather = double(traffic->all_gather) / steps;
  m.reduce_scatter = double(traffic->reduce_scatter) / steps;
  m.ring_bytes = traffic->ring_bytes(c.tensor_parallel) / steps;
  m.wait_seconds = double(traffic->wait_ns) * 1e-9 / steps;
  return m;
}

/// The actor runtime: median step time over the timed steps, and the group's collectives
/// from the trace ("tp ..." events), per step: elements by kind summed over the ranks
/// (a reduce-scatter's event gives the piece a rank gets) and the ranks' time in them.
measured run_actors(job_config c, int steps) {
  c.runtime = "actors";
  c.steps = steps + 2;  // a warm-up step, `steps` timed, and the last (its trace holds the run's end evaluation)
  actor_run_options opts;
  opts.quiet = true;
  opts.final_state = false;
  const auto r = run_actor_training(c, opts);
  if (r.exit_code != 0) throw std::runtime_error(r.error);
  std::vector<double> times(r.step_seconds.begin() + 1, r.step_seconds.begin() + 1 + steps);
  std::sort(times.begin(), times.end());
  measured m;
  m.step_seconds = times[times.size() / 2];
  const int T = c.tensor_parallel;
  for (const auto& e : r.events) {
    if (e.step < 1 || e.step > steps || e.name.rfind("tp ", 0) != 0) continue;
    const double elements = double(e.bytes) / 4;  // fp32
    if (e.name == "tp all-reduce") m.all_reduce += elements;
    if (e.name == "tp all-gather") m.all_gather += elements;
    if (e.name == "tp reduce-scatter") m.reduce_scatter += elements * T;
    m.wait_seconds += (e.end_us - e.start_us) * 1e-6;
  }
  for (double* x : {&m.all_reduce, &m.all_gather, &m.reduce_scatter, &m.wait_seconds}) *x /= steps;
  return m;
}

}  // namespace

int main(int argc, char** argv) {
  troupe::run_with_blas_kernels(argv);  // as the troupe command does
  const int steps = argc > 1 ? std::atoi(argv[1]) : 5;
  spdlog::set_level(spdlog::level::warn);  // (the actor runs' start and end lines)
  const int cores = int(std::max(1u, std::thread::hardware_concurrency()));
  torch::set_num_threads(cores);
  auto c = job_config::defaults_for("gpt-tiny");
  c.runtime = "local";
  c.device = "cpu";
  c.steps = steps + 1;
  const auto g = c.model().decoder;
  const double T = 2, L = g.n_layer, b = c.microbatch_size(), s = g.seq_len, h = g.d_model,
               mb = double(c.microbatches) * c.data_parallel;
  const double bsh = b * s * h;
  // Megatron's count, summed over the T ranks, per step.
  const double all_reduce = T * mb * ((4 * L + 2) * bsh + 2 * b * s);
  const double gather_max = T * mb * b * s * T;
  const double sp_each = T * mb * (4 * L + 2) * bsh;

  const auto one = run(c, steps);
  c.tensor_parallel = 2;
  const auto two = run(c, steps);
  c.sequence_parallel = true;
  const auto sp = run(c, steps);

  std::printf("| measure (gpt-tiny, local loop, %d cores, %d steps) | value |\n| --- | --- |\n", cores, steps);
  std::printf("%s", fmt::format("| T=2 all-reduced elements per step: measured / formula (4L+2) b s h + 2 b s per rank and micro-batch | {:.0f} / {:.0f} = {:.3f} |\n",
                                two.all_reduce, all_reduce, two.all_reduce / all_reduce).c_str());
  std::printf("%s", fmt::format("| T=2 all-gathered elements per step (cross-entropy row maxima): measured / formula | {:.0f} / {:.0f} = {:.3f} |\n",
                                two.all_gather, gather_max, two.all_gather / gather_max).c_str());
  std::printf("%s", fmt::format("| T=2 SP all-gathered elements per step: measured / formula (4L+2) b s h + maxima | {:.0f} / {:.0f} = {:.3f} |\n",
                                sp.all_gather, sp_each + gather_max, sp.all_gather / (sp_each + gather_max)).c_str());
  std::printf("%s", fmt::format("| T=2 SP reduce-scattered elements per step: measured / formula (4L+2) b s h | {:.0f} / {:.0f} = {:.3f} |\n",
                                sp.reduce_scatter, sp_each, sp.reduce_scatter / sp_each).c_str());
  std::printf("%s", fmt::format("| bytes a ring moves per step, SP / without SP | {:.1f} MB / {:.1f} MB = {:.3f} |\n",
                                sp.ring_bytes / 1e6, two.ring_bytes / 1e6, sp.ring_bytes / two.ring_bytes).c_str());
  std::printf("%s", fmt::format("| step time T=2 / T=1 (1 / {} intra-op threads per rank) | {:.3f} s / {:.3f} s = {:.2f} |\n",
                                cores, two.step_seconds, one.step_seconds, two.step_seconds / one.step_seconds).c_str());
  std::printf("%s", fmt::format("| step time T=2 with SP / T=1 | {:.3f} s / {:.3f} s = {:.2f} |\n", sp.step_seconds,
                                one.step_seconds, sp.step_seconds / one.step_seconds).c_str());
  std::printf("%s", fmt::format("| share of the ranks' time in collectives, T=2 / T=2 with SP | {:.1f} % / {:.1f} % |\n",
                                100 * two.wait_seconds / (T * two.step_seconds),
                                100 * sp.wait_seconds / (T * sp.step_seconds)).c_str());

  // The actor runtime: T stage actors per stage, the same cores (threads = 0 shares them
  // between the stage actors), the collectives from the trace.
  c.runtime = "actors";
  c.tensor_parallel = 1;
  c.sequence_parallel = false;
  c.threads = 0;
  c.eval_interval = 0;  // (the evaluation's collectives are not the step's)
  const auto a1 = run_actors(c, steps);
  c.tensor_parallel = 2;
  const auto a2 = run_actors(c, steps);
  c.sequence_parallel = true;
  const auto asp = run_actors(c, steps);
  std::printf("%s", fmt::format("| actors: T=2 all-reduced elements per step (trace): measured / formula | {:.0f} / {:.0f} = {:.3f} |\n",
                                a2.all_reduce, all_reduce, a2.all_reduce / all_reduce).c_str());
  std::printf("%s", fmt::format("| actors: T=2 SP reduce-scattered elements per step (trace): measured / formula | {:.0f} / {:.0f} = {:.3f} |\n",
                                asp.reduce_scatter, sp_each, asp.reduce_scatter / sp_each).c_str());
  std::printf("%s", fmt::format("| actors: step time T=2 / T=1 | {:.3f} s / {:.3f} s = {:.2f} |\n", a2.step_seconds,
                                a1.step_seconds, a2.step_seconds / a1.step_seconds).c_str());
  std::printf("%s", fmt::format("| actors: step time T=2 with SP / T=1 | {:.3f} s / {:.3f} s = {:.2f} |\n",
                                asp.step_seconds, a1.step_seconds, asp.step_seconds / a1.step_seconds).c_str());
  std::printf("%s", fmt::format("| actors: share of the stage actors' time in tensor-parallel collectives (trace), T=2 / T=2 with SP | {:.1f} % / {:.1f} % |\n",
                                100 * a2.wait_seconds / (T * a2.step_seconds),
                                100 * asp.wait_seconds / (T * asp.step_seconds)).c_str());
  return 0;
}
