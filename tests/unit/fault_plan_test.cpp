// The [faults] keys parsed once into a fault plan (compute/config/fault_plan.hpp), and the
// injector the actors ask.
#include <gtest/gtest.h>

#include "compute/config/fault_plan.hpp"
#include "compute/config/job_config.hpp"

namespace troupe {

namespace {

// A p2 x d2 job with `keys`.
fault_plan plan_of(std::vector<std::pair<std::string, std::string>> keys) {
  keys.insert(keys.begin(), {{"pipeline", "2"}, {"data_parallel", "2"}});
  return fault_plan::parse(load_job_config("", keys).faults());
}

std::string error_of(std::vector<std::pair<std::string, std::string>> keys) {
  try {
    plan_of(std::move(keys));
  } catch (const config_error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(FaultPlan, EveryKindParses) {
  const auto plan = plan_of({{"throw_at", "1:0:4:late"},
                             {"message", "delay=2.5@0:1:3"},
                             {"stall", "1:0:6"},
                             {"freeze", "0:1:2:8"},
                             {"kill_node", "1:5+0:9"},
                             {"kill_in_write", "1:3:0.25"},
                             {"nan_at", "7"}});
  ASSERT_TRUE(plan.stage_throw);
  EXPECT_EQ(plan.stage_throw->replica, 1);
  EXPECT_EQ(plan.stage_throw->stage, 0);
  EXPECT_EQ(plan.stage_throw->step, 4);
  EXPECT_EQ(plan.stage_throw->when, throw_point::after_update);
  ASSERT_TRUE(plan.message);
  EXPECT_EQ(plan.message->action, message_action::delay);
  EXPECT_DOUBLE_EQ(plan.message->delay_seconds, 2.5);
  EXPECT_EQ(plan.message->target, message_target::tensor);
  EXPECT_EQ(plan.message->stage, 1);
  ASSERT_TRUE(plan.stall);
  EXPECT_EQ(plan.stall->stage, 1);
  EXPECT_EQ(plan.stall->rank, 0);
  EXPECT_EQ(plan.stall->step, 6);
  ASSERT_TRUE(plan.freeze);
  EXPECT_DOUBLE_EQ(plan.freeze->seconds, 8);
  EXPECT_EQ(plan.kills, (std::map<int, std::int64_t>{{0, 9}, {1, 5}}));
  ASSERT_TRUE(plan.write_kill);
  EXPECT_EQ(plan.write_kill->node, 1);
  EXPECT_EQ(plan.write_kill->step, 3);
  EXPECT_DOUBLE_EQ(plan.write_kill->seconds, 0.25);
  EXPECT_EQ(plan.nan_at, 7);
  EXPECT_FALSE(plan.empty());
  EXPECT_FALSE(plan_of({{"kill_in_write", "0:1"}}).empty());
  EXPECT_DOUBLE_EQ(plan_of({{"kill_in_write", "0:1"}}).write_kill->seconds, 0);
  EXPECT_DOUBLE_EQ(plan_of({{"kill_in_write", "0:1:0"}}).write_kill->seconds, 0);
  EXPECT_TRUE(plan_of({}).empty());
  // Defaults: a delay of 0.3 s, a freeze of 15 s, a throw in the step.
  EXPECT_DOUBLE_EQ(plan_of({{"message", "delay@0:0:1"}}).message->delay_seconds, 0.3);
  EXPECT_DOUBLE_EQ(plan_of({{"freeze", "0:0:1"}}).freeze->seconds, 15);
  EXPECT_EQ(plan_of({{"throw_at", "0:0:1"}}).stage_throw->when, throw_point::in_step);
  EXPECT_EQ(plan_of({{"message", "drop@0:1:1:loss"}}).message->target, message_target::loss_report);
}

TEST(FaultPlan, BadKeysNameTheKeyAndValue) {
  EXPECT_NE(error_of({{"throw_at", "0:0"}}).find("faults.throw_at must be replica:stage:step"), std::string::npos);
  EXPECT_NE(error_of({{"throw_at", "0:0:1:soon"}}).find("'0:0:1:soon'"), std::string::npos);
  EXPECT_NE(error_of({{"message", "lose@0:0:1"}}).find("faults.message must be"), std::string::npos);
  EXPECT_NE(error_of({{"message", "drop=2@0:0:1"}}).find("faults.message must be"), std::string::npos);
  EXPECT_NE(error_of({{"message", "delay=-1@0:0:1"}}).find("faults.message must be"), std::string::npos);
  EXPECT_NE(error_of({{"message", "corrupt@0:1:1:loss"}}).find("carries no checksum"), std::string::npos);
  EXPECT_NE(error_of({{"message", "drop@0:0:1:loss"}}).find("come from the last stage (1), not 0"), std::string::npos);
  EXPECT_NE(error_of({{"stall", "1:0"}}).find("faults.stall must be stage:rank:step, not '1:0'"), std::string::npos);
  EXPECT_NE(error_of({{"freeze", "0:0:1:forever"}}).find("faults.freeze must be"), std::string::npos);
  for (const char* bad : {"1", "1:2:soon", "1:2:-1", "1:2:3:4", "x:2"})
    EXPECT_NE(error_of({{"kill_in_write", bad}}).find("faults.kill_in_write must be node:step[:SECONDS], not '" +
                                                       std::string(bad) + "'"),
              std::string::npos)
        << bad;
  for (const char* bad : {"1:5+1:6", "1:5+", "1", "1:-2"})
    EXPECT_NE(error_of({{"kill_node", bad}}).find("faults.kill_node must be node:step"), std::string::npos) << bad;
  EXPECT_NE(error_of({{"compute", "simulated"}, {"freeze_node", "1"}}).find("faults.freeze_node must be node:step"),
            std::string::npos);
  EXPECT_NE(error_of({{"freeze_node", "1:2"}}).find("faults.freeze_node silences a simulated node"), std::string::npos);
}

TEST(FaultPlan, TheInjectorFiresInTheFirstAttemptOfItsStepOnly) {
  fault_injector faults(plan_of({{"throw_at", "0:1:3"},
                                 {"message", "drop@1:0:2"},
                                 {"stall", "1:1:4"},
                                 {"freeze", "0:0:5:2"},
                                 {"kill_node", "1:6"},
                                 {"nan_at", "7"}}));
  EXPECT_TRUE(faults.stage_throws(0, 1, 3, 0, throw_point::in_step));
  EXPECT_FALSE(faults.stage_throws(0, 1, 3, 1, throw_point::in_step));  // the retry runs clean
  EXPECT_FALSE(faults.stage_throws(0, 1, 3, 0, throw_point::after_update));
  EXPECT_FALSE(faults.stage_throws(1, 1, 3, 0, throw_point::in_step));
  EXPECT_FALSE(faults.take_message(1, 0, 2, 0, message_target::loss_report));
  EXPECT_FALSE(faults.take_message(1, 0, 2, 1, message_target::tensor));
  EXPECT_TRUE(faults.take_message(1, 0, 2, 0, message_target::tensor));
  EXPECT_FALSE(faults.take_message(1, 0, 2, 0, message_target::tensor)) << "a message fault fires once";
  EXPECT_TRUE(faults.shard_stalls(1, 1, 4, 0));
  EXPECT_FALSE(faults.shard_stalls(1, 0, 4, 0));
  EXPECT_EQ(faults.take_freeze(0, 0, 5, 0), 2.0);
  EXPECT_FALSE(faults.take_freeze(0, 0, 5, 0)) << "a freeze fires once";
  EXPECT_TRUE(faults.kills_node(1, 6, 0));
  EXPECT_FALSE(faults.kills_node(0, 6, 0));
  EXPECT_FALSE(faults.write_kill(1, 6)) << "no kill_in_write in this plan";
  fault_injector writes(plan_of({{"kill_in_write", "1:4:0.5"}}));
  EXPECT_EQ(writes.write_kill(1, 4), 0.5);
  EXPECT_FALSE(writes.write_kill(0, 4));
  EXPECT_FALSE(writes.write_kill(1, 3));
  EXPECT_TRUE(faults.nan_loss(7, 0));
  EXPECT_FALSE(faults.nan_loss(7, 1));
  EXPECT_FALSE(fault_injector().nan_loss(0, 0)) << "an empty plan fires nothing";
  const auto silent = plan_of({{"compute", "simulated"}, {"freeze_node", "1:4+2:6"}});
  EXPECT_EQ(silent.freezes, (std::map<int, std::int64_t>{{1, 4}, {2, 6}}));
  EXPECT_FALSE(silent.empty());
  fault_injector frozen(silent);
  EXPECT_TRUE(frozen.freezes_node(1, 4, 0));
  EXPECT_FALSE(frozen.freezes_node(1, 4, 1));  // the retry runs clean
  EXPECT_FALSE(frozen.freezes_node(1, 6, 0));
  EXPECT_FALSE(frozen.kills_node(1, 4, 0));
}

}  // namespace troupe
