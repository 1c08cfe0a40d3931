// The actor runtime against the single-process reference loop: the same parameters and
// losses for every schedule kind, pipeline depth and data parallelism, and each stage ran
// exactly its schedule's order.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <thread>

#include <nlohmann/json.hpp>

#include "actor_test_util.hpp"
#include "actors/runtime.hpp"
#include "actors/supervisor_actor.hpp"
#include "actors/trace.hpp"
#include "compute/checkpoint/checkpoint.hpp"
#include "compute/optim/grad_buffer.hpp"
#include "compute/models/partition.hpp"
#include "compute/trainer/local_trainer.hpp"
#include "test_util.hpp"

namespace troupe {

using namespace actor_test;

class ActorEquivalence : public ::testing::TestWithParam<layout> {};

TEST_P(ActorEquivalence, SameParametersAndLossesAsTheReferenceLoop) {
  const auto l = GetParam();
  const auto c = gpt_layout(l);
  const auto got = run_actors(c);
  ASSERT_EQ(got.exit_code, 0) << got.error;
  const auto& ref = gpt_reference();
  EXPECT_LE(test::max_abs_diff(got.final_state, ref.state), 1e-5) << name_of(l);
  ASSERT_EQ(got.losses.size(), ref.losses.size());
  for (std::size_t i = 0; i < ref.losses.size(); ++i) EXPECT_NEAR(got.losses[i], ref.losses[i], 1e-5) << "step " << i;

  // Every stage ran exactly its schedule's order (fixed-order kinds), every step; under
  // dataflow, every micro-batch's F, then its B, then (split) its W, once each.
  if (std::string(l.schedule) == "dataflow") {
    for (std::int64_t s = 0; s < kSteps; ++s) {
      const auto ops = executed(got.events, s);
      ASSERT_EQ(ops.size(), std::size_t(l.p * l.d));
      for (const auto& [track, order] : ops) {
        EXPECT_EQ(order.size(), std::size_t((l.split_backward ? 3 : 2) * c.microbatches));
        std::map<int, std::string> seen;  // micro-batch: its ops' letters in order
        for (const auto& op : order) seen[op.mb] += op_letter(op.kind);
        for (int mb = 0; mb < c.microbatches; ++mb)
          EXPECT_EQ(seen[mb], l.split_backward ? "FBW" : "FB") << "step " << s << " stage " << track.second;
      }
    }
  } else {
    const auto sched = make_schedule(parse_schedule_kind(l.schedule), c.pipeline, c.microbatches, c.chunks);
    for (std::int64_t s : {0, kSteps - 1}) {
      const auto ops = executed(got.events, s);
      ASSERT_EQ(ops.size(), std::size_t(l.p * l.d));
      for (const auto& [track, order] : ops)
        EXPECT_EQ(order, as_traced(sched.ranks[track.second])) << "replica " << track.first << " stage " << track.second;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, ActorEquivalence,
    // One layout per schedule kind and dimension: 1f1b alone, deep, and with replicas;
    // each other kind deep and with replicas (interleaved also without); gradient buckets
    // reduce-scattered during the last backward under 1f1b, interleaving and dataflow. The
    // V kinds hold both copies of the tied embedding on stage 0; dualpipev splits some
    // backwards and keeps others whole, with buckets too. Loaders send a step's
    // micro-batches at its begin, or a window ahead, one more per credit of stage 0.
    ::testing::Values(layout{1, 1, 1, "1f1b"}, layout{1, 1, 1, "1f1b", false, 0, 1}, layout{4, 1, 1, "1f1b"},
                      layout{2, 2, 1, "1f1b"}, layout{4, 2, 1, "gpipe"},
                      layout{4, 1, 2, "interleaved-1f1b", false, 0, 2}, layout{2, 2, 2, "interleaved-1f1b"},
                      layout{4, 2, 1, "dataflow", false, 0, 3},
                      layout{4, 2, 1, "dataflow", true}, layout{4, 2, 1, "zero-bubble"},
                      layout{2, 2, 1, "1f1b", false, 20000}, layout{2, 2, 2, "interleaved-1f1b", false, 20000},
                      layout{4, 2, 1, "dataflow", true, 20000}, layout{2, 2, 2, "combined-1f1b"},
                      layout{4, 1, 2, "zbv"}, layout{4, 1, 2, "dualpipev"},
                      layout{2, 2, 2, "dualpipev", false, 20000}),
    [](const auto& info) { return name_of(info.param); });

}  // namespace troupe
