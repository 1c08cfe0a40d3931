#pragma once
// Shared by the tensor-parallel tests (the local loop's, the actor runtime's): a small
// decoder job and the layouts they sweep.
#include <ostream>
#include <string>

#include "compute/config/job_config.hpp"

namespace troupe::tp_test {

/// gpt-tiny (or llama-tiny) made small for the local loop: 4 blocks, d_model 64, 4 heads,
/// 32 positions; 10 steps take about a second.
inline job_config small_job(const std::string& workload = "gpt-tiny") {
  auto c = job_config::defaults_for(workload);
  c.steps = 10;
  c.device = "cpu";
  c.runtime = "local";
  c.layers = 4;
  c.d_model = 64;
  c.heads = 4;
  c.seq_len = 32;
  c.global_batch = 8;
  c.microbatches = 2;
  c.eval_interval = 0;
  return c;
}

/// A layout: tensor-parallel width, pipeline, data parallelism, sequence parallelism,
/// the workload, the schedule and the recompute mode.
struct tp_layout {
  int t, p, d;
  bool sp;
  const char* workload;
  const char* schedule;
  const char* recompute;
};

/// As a gtest name: gpt2_t2_sp_p2_d1_zero_bubble_recompute_full.
inline std::string name_of(const tp_layout& l) {
  std::string s = std::string(l.workload[0] == 'g' ? "gpt2" : "llama") + "_t" + std::to_string(l.t) +
                  (l.sp ? "_sp" : "") + "_p" + std::to_string(l.p) + "_d" + std::to_string(l.d);
  const std::string k = l.schedule;
  if (k != "1f1b") s += "_" + (k == "zero-bubble" ? "zero_bubble" : k == "gpipe" ? k : "interleaved");
  if (std::string(l.recompute) != "none") s += std::string("_recompute_") + l.recompute;
  return s;
}

inline void PrintTo(const tp_layout& l, std::ostream* os) { *os << name_of(l); }

/// `base` with the layout `l` (interleaved: 2 chunks).
inline job_config with_layout(job_config c, const tp_layout& l) {
  c.tensor_parallel = l.t;
  c.sequence_parallel = l.sp;
  c.pipeline = l.p;
  c.data_parallel = l.d;
  c.schedule = l.schedule;
  c.recompute = l.recompute;
  if (c.schedule == "interleaved-1f1b") c.chunks = 2;
  return c;
}

/// The largest elementwise difference of `a` and `b`.
inline double diff(const torch::Tensor& a, const torch::Tensor& b) { return (a - b).abs().max().item<double>(); }

}  // namespace troupe::tp_test
