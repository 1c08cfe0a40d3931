// The schedule kinds that pair a forward with a backward or run a V (combined-1f1b, zbv,
// dualpipev) for the llama architecture and its experts, against one process running
// 1f1b.
#include <gtest/gtest.h>

#include <fstream>

#include <nlohmann/json.hpp>

#include "actor_test_util.hpp"
#include "compute/models/partition.hpp"
#include "quiet_run.hpp"

namespace troupe {

using namespace actor_test;

// combined-1f1b, zbv and dualpipev each follow one process running 1f1b (and so 1f1b
// itself), for llama-tiny and for moe-tiny: in the actor runtime (each stage ran its
// order) and in the local loop. Split backwards run the router and the experts' weight
// gradients as W's; dualpipev's whole backwards compute them at once.
TEST(ScheduleKinds, CombinedZbvAndDualPipeVFollowOneProcessForLlamaAndExperts) {
  for (const char* workload : {"llama-tiny", "moe-tiny"}) {
    auto c = test::gpt_config(200);
    c.workload = workload;
    c.layers = 4;
    c.d_model = 64;
    c.seq_len = 32;
    c.eval_interval = 0;
    c.microbatches = 4;
    const auto ref = reference_of(c);
    for (const char* kind : {"combined-1f1b", "zbv", "dualpipev"}) {
      auto a = c;
      a.pipeline = 2;
      a.chunks = 2;
      a.schedule = kind;
      const std::string at = std::string(workload) + " " + kind;
      const auto got = run_actors(a);
      ASSERT_EQ(got.exit_code, 0) << at << ": " << got.error;
      EXPECT_LE(test::max_abs_diff(got.final_state, ref.state), 1e-5) << at;
      for (std::size_t i = 0; i < ref.losses.size(); ++i) EXPECT_NEAR(got.losses[i], ref.losses[i], 1e-5) << at << " step " << i;
      const auto sched = make_schedule(parse_schedule_kind(kind), 2, 4, 2);
      const auto ran = executed(got.events, kSteps - 1);
      ASSERT_EQ(ran.size(), 2u) << at;
      for (const auto& [track, order] : ran)
        EXPECT_EQ(order, as_traced(sched.ranks[track.second])) << at << " stage " << track.second;
      a.runtime = "local";
      local_trainer local(a);
      for (std::size_t i = 0; i < ref.losses.size(); ++i) EXPECT_NEAR(local.step().loss, ref.losses[i], 1e-5) << at << " local step " << i;
      EXPECT_LE(test::max_abs_diff(local.state(), ref.state), 1e-5) << at << " local";
    }
  }
}

}  // namespace troupe
