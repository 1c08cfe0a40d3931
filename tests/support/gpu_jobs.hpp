#pragma once
// Small jobs of the device and precision tests (tests/gpu/): run in this process, on the
// CPU or a GPU, in fp32 or bf16.
#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "actors/runtime.hpp"
#include "compute/checkpoint/checkpoint.hpp"
#include "test_util.hpp"

namespace troupe::gpu_jobs {

/// `steps` steps of `c` with the actors, quiet (the lr schedule of c.steps where longer).
inline actor_run_result run(job_config c, int steps) {
  c.steps = std::max(c.steps, steps);  // keep the lr schedule of the longer run
  actor_run_options opts;
  opts.quiet = true;
  auto cfg = c;
  cfg.steps = steps;
  return run_actor_training(cfg, opts);
}

inline job_config tiny(int p, int d, int v, const char* schedule, const char* device, const char* precision = "fp32") {
  auto c = test::gpt_config(200);
  c.pipeline = p;
  c.data_parallel = d;
  c.chunks = v;
  c.schedule = schedule;
  c.microbatches = d == 1 ? 8 : 4;
  c.device = device;
  c.precision = precision;
  return c;
}

/// The tensor called `name` in `sd`.
inline const torch::Tensor& saved_value(const state_dict& sd, const std::string& name) {
  for (const auto& [n, t] : sd)
    if (n == name) return t;
  throw std::out_of_range(name);
}

/// The mean of the last `n` of `xs`.
inline double mean_of_last(const std::vector<double>& xs, std::size_t n) {
  double s = 0;
  for (std::size_t i = xs.size() - n; i < xs.size(); ++i) s += xs[i];
  return s / double(n);
}

}  // namespace troupe::gpu_jobs
