#pragma once
// Helpers shared by the tests.
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include <torch/types.h>

#include "compute/checkpoint/checkpoint.hpp"
#include "compute/config/job_config.hpp"
#include "compute/models/model.hpp"
#include "temp_dir.hpp"

namespace troupe::test {

/// Max abs difference between two state_dicts of the same names (order may differ).
inline double max_abs_diff(const state_dict& a, const state_dict& b) {
  double worst = 0;
  for (const auto& [name, t] : a) {
    bool found = false;
    for (const auto& [n2, u] : b)
      if (n2 == name) {
        worst = std::max(worst, (t - u).abs().max().item<double>());
        found = true;
      }
    if (!found) return INFINITY;
  }
  return a.size() == b.size() ? worst : INFINITY;
}

/// The message of the config_error that `c.validate()` throws; "" when `c` is valid.
inline std::string config_error_of(const job_config& c) {
  try {
    c.validate();
  } catch (const config_error& e) {
    return e.what();
  }
  return "";
}

/// gpt-tiny's configuration with a short run, on the CPU (the reference loop's device,
/// also on GPU machines; tests/gpu/gpu_equivalence_test.cpp compares devices).
inline job_config gpt_config(int steps) {
  auto c = job_config::defaults_for("gpt-tiny");
  c.steps = steps;
  c.device = "cpu";
  return c;
}

/// The model the tests of layouts, schedules, runtimes and recovery train: gpt-tiny's
/// workload (or another one's, set after) at half its width and sequence length. What they
/// compare (against one process, the plain loop, the fault-free run) is the same at any
/// width; a step costs about a third of the CPU time (the test suite is CPU-bound).
/// tests/support/launcher_lib.sh gives the shell tests' jobs the same ($small).
inline job_config small_config(int steps) {
  auto c = gpt_config(steps);
  c.d_model = 64;
  c.seq_len = 64;
  return c;
}

/// A reference run shared by the test processes that compare with it (CTest runs every
/// test in a process of its own, and many compare with the same plain run): `make()`
/// computes it (its parameters, and its losses into `losses`) once per build of this test
/// binary; the others read it from a file in the system's temporary folder named after
/// `name` and the binary's identity (its size and modification time), written
/// atomically. A stale file of another build is never read.
inline state_dict shared_reference(const std::string& name, const std::function<state_dict(std::vector<double>*)>& make,
                                   std::vector<double>* losses = nullptr) {
  struct stat self {};
  ::stat("/proc/self/exe", &self);
  const auto dir = std::filesystem::temp_directory_path() / ("troupe-test-references-" + std::to_string(::getuid()));
  std::filesystem::create_directories(dir);
  const auto file = dir / (name + "-" + std::to_string(self.st_size) + "-" + std::to_string(self.st_mtim.tv_sec) + "." +
                           std::to_string(self.st_mtim.tv_nsec) + ".pt");
  const auto take_losses = [losses](state_dict sd) {
    state_dict out;
    for (auto& [n, t] : sd) {
      if (n != "losses") {
        out.emplace_back(n, t);
      } else if (losses) {
        losses->assign(t.data_ptr<double>(), t.data_ptr<double>() + t.numel());
      }
    }
    return out;
  };
  if (std::filesystem::exists(file)) return take_losses(load_state_dict(file.string()));
  std::vector<double> made_losses;
  auto state = make(&made_losses);
  auto saved = state;
  saved.emplace_back("losses", torch::tensor(made_losses, torch::kDouble));
  const auto tmp = file.string() + "." + std::to_string(::getpid());
  save_state_dict(tmp, saved);
  std::filesystem::rename(tmp, file);
  if (losses) *losses = made_losses;
  return state;
}

}  // namespace troupe::test
