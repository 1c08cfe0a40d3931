#pragma once
// A whole actor-runtime job run in this process without its console output (tests).
#include "actors/runtime.hpp"

namespace troupe::test {

inline actor_run_result run_quietly(const job_config& c) {
  actor_run_options opts;
  opts.quiet = true;
  return run_actor_training(c, opts);
}

}  // namespace troupe::test
