#pragma once
// Training with the local loop (compute/trainer) for the unit tests.
#include <vector>

#include "compute/checkpoint/checkpoint.hpp"
#include "compute/config/job_config.hpp"
#include "compute/trainer/local_trainer.hpp"

namespace troupe::test {

/// `steps` steps of `cfg` in the local loop (each step's loss into `losses`); its final parameters.
inline state_dict train(job_config cfg, int steps, std::vector<double>* losses = nullptr) {
  local_trainer t(cfg);
  for (int i = 0; i < steps; ++i) {
    auto st = t.step();
    if (losses) losses->push_back(st.loss);
  }
  return t.state();
}

}  // namespace troupe::test
