// launch/environment.hpp: the one place that reads a troupe process's environment (what
// launch/troupe sets for a restart, the benchmarks' hooks) into launch_info.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "compute/config/job_config.hpp"
#include "launch/environment.hpp"

namespace {

/// Sets variables for one test and puts the old values back.
struct environment_guard {
  std::vector<std::pair<std::string, std::optional<std::string>>> saved;
  void set(const std::string& name, const char* value) {
    const char* old = std::getenv(name.c_str());
    saved.emplace_back(name, old ? std::optional<std::string>(old) : std::nullopt);
    value ? ::setenv(name.c_str(), value, 1) : ::unsetenv(name.c_str());
  }
  ~environment_guard() {
    for (auto it = saved.rbegin(); it != saved.rend(); ++it)
      it->second ? ::setenv(it->first.c_str(), it->second->c_str(), 1) : ::unsetenv(it->first.c_str());
  }
};

}  // namespace

TEST(LaunchEnvironment, TheLaunchersVariablesBecomeTheLaunchInfo) {
  environment_guard env;
  for (const char* name : {"TROUPE_LAUNCH_ATTEMPT", "TROUPE_RESUME_AUTO", "TROUPE_FAILED_AT", "TROUPE_REGROW_AT",
                           "TROUPE_BACKWARD_ON_STAGE_THREAD", "TROUPE_BLOCKING_INPUT_COPIES", "TROUPE_TEST_ALLTOALL_DELAY_MS",
                           "TROUPE_KERNEL_PROFILE"})
    env.set(name, nullptr);
  auto l = troupe_cli::launch_info_from_environment();
  EXPECT_EQ(l.attempt, 0);
  EXPECT_FALSE(l.resume_auto);
  EXPECT_FALSE(l.failed_at);
  EXPECT_FALSE(l.regrow_at);
  EXPECT_FALSE(l.backward_on_stage_threads);
  EXPECT_FALSE(l.blocking_input_copies);
  EXPECT_EQ(l.all_to_all_delay.count(), 0);
  EXPECT_EQ(l.kernel_profile, "");
  env.set("TROUPE_LAUNCH_ATTEMPT", "2");
  env.set("TROUPE_RESUME_AUTO", "1");
  env.set("TROUPE_FAILED_AT", "1790000000.25");
  env.set("TROUPE_BACKWARD_ON_STAGE_THREAD", "1");
  env.set("TROUPE_BLOCKING_INPUT_COPIES", "1");
  env.set("TROUPE_TEST_ALLTOALL_DELAY_MS", "2.5");
  env.set("TROUPE_KERNEL_PROFILE", "k.json:3:4");
  l = troupe_cli::launch_info_from_environment();
  EXPECT_EQ(l.attempt, 2);
  EXPECT_TRUE(l.resume_auto);
  ASSERT_TRUE(l.failed_at);
  EXPECT_DOUBLE_EQ(*l.failed_at, 1790000000.25);
  EXPECT_FALSE(l.regrow_at);
  EXPECT_TRUE(l.backward_on_stage_threads);
  EXPECT_TRUE(l.blocking_input_copies);
  EXPECT_EQ(l.all_to_all_delay.count(), 2500);
  EXPECT_EQ(l.kernel_profile, "k.json:3:4");
  env.set("TROUPE_REGROW_AT", "soon");
  try {
    troupe_cli::launch_info_from_environment();
    ADD_FAILURE() << "a time that is not a number was taken";
  } catch (const troupe::config_error& e) {
    EXPECT_NE(std::string(e.what()).find("TROUPE_REGROW_AT must be a number, not 'soon'"), std::string::npos) << e.what();
  }
}
