#pragma once
// What the launcher tells a run besides its job configuration. launch/ reads it from the
// environment once (launch/cli_common.hpp, launch_info_from_environment: the TROUPE_*
// variables launch/troupe sets, and the benchmarks' hooks) and hands it down; nothing
// below launch/ reads an environment variable of Troupe's.
#include <chrono>
#include <optional>
#include <string>

namespace troupe {

struct launch_info {
  /// Launches of this job before this one (TROUPE_LAUNCH_ATTEMPT): the launcher's
  /// restarts; the fault plan of attempt N is injected only in launch N.
  int attempt = 0;
  /// The launcher restarts the job (TROUPE_RESUME_AUTO=1): the newest checkpoint of
  /// checkpoint_dir wins over the configured resume (resolve_resume).
  bool resume_auto = false;
  /// A restart after a failure seen at this time (TROUPE_FAILED_AT, seconds since the
  /// epoch), or a launch that takes hosts back whose stop was requested then
  /// (TROUPE_REGROW_AT): the metrics' resume line gives the time to the first step.
  std::optional<double> failed_at, regrow_at;
  /// Benchmarks: every backward on its stage actor's thread (TROUPE_BACKWARD_ON_STAGE_THREAD=1).
  bool backward_on_stage_threads = false;
  /// Benchmarks: a stage copies its inputs and targets to the GPU with a plain `.to()`,
  /// which waits for its stream (TROUPE_BLOCKING_INPUT_COPIES=1; to_device_async's A/B).
  bool blocking_input_copies = false;
  /// Benchmarks: every all-to-all lasts this much longer, as a network with that latency
  /// would (TROUPE_TEST_ALLTOALL_DELAY_MS; this kernel has no netem).
  std::chrono::microseconds all_to_all_delay{0};
  /// A kernel profile of some steps (TROUPE_KERNEL_PROFILE=FILE[:FIRST[:LAST]];
  /// compute/runtime/kernel_profile.hpp); empty: none.
  std::string kernel_profile;
};

}  // namespace troupe
