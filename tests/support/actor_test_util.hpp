#pragma once
// Shared by the actor runtime's tests: the single-process reference run they compare
// with, the layouts they sweep, and the ops each stage ran (from the trace).
#include <algorithm>
#include <map>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "actors/runtime.hpp"
#include "compute/schedule/schedule.hpp"
#include "compute/trainer/local_trainer.hpp"
#include "test_util.hpp"

namespace troupe::actor_test {

inline constexpr int kSteps = 6;

struct reference_run {
  state_dict state;
  std::vector<double> losses;
};

/// gpt-tiny's data and training with llama-tiny's model (test::small_config's width).
inline job_config llama_config(int steps) {
  auto c = test::small_config(steps);
  c.workload = "llama-tiny";
  return c;
}

inline reference_run reference_of(job_config c) {
  c.pipeline = c.data_parallel = c.chunks = 1;
  c.schedule = "1f1b";
  c.runtime = "local";
  local_trainer t(c);
  reference_run out;
  for (int i = 0; i < kSteps; ++i) out.losses.push_back(t.step().loss);
  out.state = t.state();
  return out;
}

/// The small gpt-tiny's reference run (test::small_config), computed once per build
/// (test::shared_reference).
inline const reference_run& gpt_reference() {
  static const reference_run ref = [] {
    reference_run r;
    r.state = test::shared_reference(
        "actors-small-gpt-tiny-reference-6-steps",
        [](std::vector<double>* losses) {
          auto run = reference_of(test::small_config(200));
          *losses = run.losses;
          return run.state;
        },
        &r.losses);
    return r;
  }();
  return ref;
}

inline actor_run_result run_actors(job_config c, actor_run_options opts = {}) {
  opts.quiet = true;
  c.steps = std::min(c.steps, kSteps);
  return run_actor_training(c, opts);
}

/// Runs `c` through the actor runtime with `keys` set and expects the parameters and the
/// losses of the one-process loop (no tensor, sequence or expert parallelism, no
/// recomputation) within 1e-5; returns the one-process job and its run.
inline std::pair<job_config, reference_run> expect_one_process_result(
    job_config c, const std::vector<std::pair<std::string, std::string>>& keys, const std::string& name) {
  for (const auto& [key, value] : keys) c.set(key, value, "test");
  c.validate();
  auto one = c;
  one.tensor_parallel = one.expert_parallel = one.context_parallel = 1;
  one.context_parallel_comm = "p2p";
  one.sequence_parallel = false;
  one.recompute = "none";
  auto ref = reference_of(one);
  const auto got = run_actors(c);
  EXPECT_EQ(got.exit_code, 0) << name << ": " << got.error;
  EXPECT_LE(test::max_abs_diff(got.final_state, ref.state), 1e-5) << name;
  EXPECT_GT(test::max_abs_diff(got.final_state, initial_state(c.model(), c.seed)), 1e-3)
      << name << ": parameters did not move";
  EXPECT_EQ(got.losses.size(), ref.losses.size()) << name;
  for (std::size_t i = 0; i < std::min(ref.losses.size(), got.losses.size()); ++i)
    EXPECT_NEAR(got.losses[i], ref.losses[i], 1e-5) << name << " step " << i;
  return {one, std::move(ref)};
}

/// A layout given as job keys (key, value), named for gtest's parameterised tests.
struct keyed_layout {
  const char* name;
  std::vector<std::pair<std::string, std::string>> keys;
};

inline void PrintTo(const keyed_layout& l, std::ostream* os) { *os << l.name; }

struct layout {
  int p, d, v;
  const char* schedule;
  bool split_backward = false;  // dataflow
  std::int64_t bucket_size = 0;  // gradient buckets (parallel.bucket_size)
  int credit_window = 0;         // parallel.credit_window (0: the loader sends the whole step at once)
};

inline std::string name_of(const layout& l) {
  std::string k = l.schedule;
  if (k == "interleaved-1f1b") k = "interleaved";
  std::replace(k.begin(), k.end(), '-', '_');  // gtest names: letters, digits, _
  return "p" + std::to_string(l.p) + "_d" + std::to_string(l.d) + "_v" + std::to_string(l.v) + "_" + k +
         (l.split_backward ? "_split" : "") + (l.bucket_size ? "_buckets" : "") +
         (l.credit_window ? "_credits" + std::to_string(l.credit_window) : "");
}

inline void PrintTo(const layout& l, std::ostream* os) { *os << name_of(l); }

inline job_config gpt_layout(const layout& l) {
  auto c = test::small_config(200);  // the lr schedule of a 200-step run; kSteps run
  c.pipeline = l.p;
  c.data_parallel = l.d;
  c.chunks = l.v;
  c.schedule = l.schedule;
  c.split_backward = l.split_backward;
  c.bucket_size = l.bucket_size;
  c.credit_window = l.credit_window;
  c.microbatches = l.d == 1 ? 8 : 4;
  return c;
}

/// Per (replica, stage): the F/B/W ops of step `step` in the order they ran.
inline std::map<std::pair<int, int>, std::vector<pipeline_op>> executed(const std::vector<trace_event>& events,
                                                                 std::int64_t step) {
  std::vector<const trace_event*> evs;
  for (const auto& e : events)
    if (e.step == step && (e.name == "F" || e.name == "B" || e.name == "W")) evs.push_back(&e);
  std::stable_sort(evs.begin(), evs.end(), [](auto* a, auto* b) { return a->start_us < b->start_us; });
  std::map<std::pair<int, int>, std::vector<pipeline_op>> out;
  for (auto* e : evs)
    out[{e->replica, e->stage}].push_back(
        {e->name == "F" ? op_kind::forward : e->name == "B" ? op_kind::backward : op_kind::weight, e->mb, e->chunk});
  return out;
}

/// A stage's order as the trace can show it: kind, micro-batch and chunk of each op (not
/// whether a backward was split or an op paired).
inline std::vector<pipeline_op> as_traced(std::vector<pipeline_op> ops) {
  for (auto& op : ops) op.split = op.paired = false;
  return ops;
}

}  // namespace troupe::actor_test
