#pragma once
// Helpers shared by the tests.
#include <cstdlib>
#include <filesystem>
#include <string>

#include <torch/types.h>

#include "compute/job_config.hpp"
#include "compute/model.hpp"
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

/// gpt-tiny's configuration with a short run, on the CPU (the reference loop's device,
/// also on GPU machines; tests/gpu_test.cpp compares devices).
inline job_config gpt_config(int steps) {
  auto c = job_config::defaults_for("gpt-tiny");
  c.steps = steps;
  c.device = "cpu";
  return c;
}

}  // namespace troupe::test
