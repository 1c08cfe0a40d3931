#pragma once
// `troupe plan`: the best layouts for a model on N devices (compute/plan/planner.hpp).
#include <string>

#include <CLI/CLI.hpp>

#include "compute/plan/planner.hpp"

namespace troupe_cli {

struct plan_command {
  CLI::App* cmd = nullptr;
  std::string workload = "gpt-tiny", model_dir, device = "h100", network, format = "table", attention;
  int devices = 0, per_node = 0, seq_len = 0, global_batch = 0, top = 10;
  troupe::plan::search_limits limits;
  std::string recompute;
};

/// Adds the subcommand and its flags to `app`.
plan_command& add_plan_command(CLI::App& app);
/// Runs it (after parsing): prints the ranked layouts; returns the exit status.
int run_plan(const plan_command& p);

}  // namespace troupe_cli
