#pragma once
// A GPU kernel profile of chosen training steps: LibTorch's Kineto profiler (CUPTI) records
// every CUDA kernel and copy of the process while it runs and writes a Chrome trace JSON
// (`tests/bench/kernel_summary.py` sums it up). Builds against LibTorch 2.x with CUDA; in
// other builds `available()` is false and `start` says why.
//
// Enabled by the environment: TROUPE_KERNEL_PROFILE=FILE[:FIRST[:LAST]] profiles training
// steps FIRST..LAST (0-based, default 5..6) of a `troupe train` process that drives the
// steps (the coordinator's: one process, or node 0), writing FILE after step LAST.
#include <memory>
#include <optional>
#include <string>

namespace troupe {

struct kernel_profile_request {
  std::string path;
  int first = 5, last = 6;
};

/// A kernel profile request, FILE[:FIRST[:LAST]] (launch_info::kernel_profile, from
/// TROUPE_KERNEL_PROFILE), parsed; nullopt when empty. Throws std::invalid_argument on a
/// malformed value.
std::optional<kernel_profile_request> parse_kernel_profile(const std::string& request);

/// Throws std::invalid_argument when `request` is malformed, or set where this build
/// cannot profile kernels: before a run starts rather than at its first step.
void check_kernel_profile(const std::string& request);

class kernel_profile {
 public:
  static bool available();
  kernel_profile();
  ~kernel_profile();  // stops a profile still running, writing nothing
  kernel_profile(const kernel_profile&) = delete;
  kernel_profile& operator=(const kernel_profile&) = delete;

  /// Starts recording (from any thread: the profiler lives on a thread of its own).
  /// Throws std::runtime_error where the build has no kernel profiler.
  void start();
  /// Stops recording and writes the Chrome trace to `path`.
  void stop(const std::string& path);
  bool running() const;

 private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

}  // namespace troupe
