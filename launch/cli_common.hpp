#pragma once
// What the troupe command's subcommands share: the configuration flags (every key of
// compute/config/job_config.hpp, plus --config, plus the environment's faults), exit statuses,
// error lines, and the signal handlers of a process that runs a job.
#include <deque>
#include <functional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>

#include "compute/config/job_config.hpp"
#include "launch/environment.hpp"

namespace troupe_cli {

constexpr int exit_usage = 2;  ///< bad arguments or configuration

/// Prints "troupe: error: MSG" and returns `code`.
int fail(int code, const std::string& msg);
/// A run's end other than 0: an error, or a stop on request (SIGTERM / SIGUSR1), which
/// is no error (its checkpoint is written).
int run_ended(int code, const std::string& msg);
/// The environment variable `name`, or `fallback` when it is unset or empty.
/// SIGTERM and SIGUSR1 to the coordinator's process (or the local loop's) stop the run
/// after its step, with a checkpoint (compute/trainer/local_trainer.hpp: exit_stopped); SIGUSR2 has it
/// log what every actor waits for. Other nodes ignore SIGUSR1 (SLURM's --signal reaches
/// every task; node 0 ends the job) and SIGUSR2, and end on SIGTERM as before.
void install_stop_handlers(bool coordinator);

/// One flag per configuration key on `cmd` (those `wanted` takes, or all), plus --config.
struct config_flags {
  struct flag {
    CLI::Option* option = nullptr;
    std::string value, key;
    std::vector<std::string> values;  ///< a list key's (config_key::list)
  };
  std::string config_path;
  std::deque<flag> keys;  // stable addresses

  /// `config_must_exist` false: a --config file that is not there is the command's to
  /// report (check-host: a fault of the host, not of the job).
  void add_to(CLI::App* cmd, const std::function<bool(const std::string&)>& wanted = {}, bool config_must_exist = true) {
    auto* config = cmd->add_option("--config", config_path, "job config (TOML); flags override it");
    if (config_must_exist) config->check(CLI::ExistingFile);
    for (const auto& key : troupe::config_keys()) {
      if (wanted && !wanted(key.name)) continue;
      keys.push_back({nullptr, "", key.name, {}});
      auto& k = keys.back();
      k.option = key.list ? cmd->add_option(key.flag(), k.values, key.help + " [" + key.name + "]")
                          : cmd->add_option(key.flag(), k.value, key.help + " [" + key.name + "]");
    }
  }
  /// The flags given on the command line, as "--flag" text.
  std::vector<std::string> given() const {
    std::vector<std::string> out;
    for (const auto& k : keys)
      if (k.option->count() > 0) out.push_back(k.option->get_name());
    if (!config_path.empty()) out.push_back("--config");
    return out;
  }
  /// The configuration: file, then the environment's faults, then flags, then `last`.
  troupe::job_config load(const std::vector<std::pair<std::string, std::string>>& last = {}) const {
    std::vector<std::pair<std::string, std::string>> overrides;
    // TROUPE_FAULTS="kill_node=1:7,throw_at=0:1:3": [faults] keys from the environment;
    // TROUPE_FAULTS_<N>: faults of the launcher's N-th restart (faults.attempt = N).
    const std::string attempt = env_or("TROUPE_LAUNCH_ATTEMPT", "0");
    std::string faults = env_or(("TROUPE_FAULTS_" + attempt).c_str(), "");
    if (!faults.empty())
      overrides.emplace_back("faults.attempt", attempt);
    else
      faults = env_or("TROUPE_FAULTS", "");
    {
      std::stringstream in(faults);
      std::string item;
      while (std::getline(in, item, ',')) {
        if (item.empty()) continue;
        const auto eq = item.find('=');
        if (eq == std::string::npos)
          throw troupe::config_error("TROUPE_FAULTS: '" + item + "' is not key=value (e.g. kill_node=1:7)");
        overrides.emplace_back("faults." + item.substr(0, eq), item.substr(eq + 1));
      }
    }
    for (const auto& k : keys) {
      if (k.option->count() == 0) continue;
      std::string value = k.value;
      for (const auto& v : k.values) value += (value.empty() ? "" : "\n") + v;
      overrides.emplace_back(k.key, value);
    }
    overrides.insert(overrides.end(), last.begin(), last.end());
    return troupe::load_job_config(config_path, overrides);
  }
};

/// `troupe node` (also run as `troupe-node`): one node of a multi-process job, its place
/// in the job from the environment the launcher sets (launch/node_main.cpp).
int run_node_command(const config_flags& flags);

}  // namespace troupe_cli
