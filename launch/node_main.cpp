// `troupe node` (also run as `troupe-node`): the main of one node process of a
// multi-process job. The launcher (launch/troupe) starts it with its place in the job in
// the environment; node 0 also takes the job's flags (the other nodes receive the job).
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <stdexcept>

#include "actors/node.hpp"
#include "compute/runtime/device.hpp"
#include "launch/cli_common.hpp"

namespace troupe_cli {

int run_node_command(const config_flags& flags) {
  troupe::node_options o;
  try {
    o.node = std::stoi(env_or("TROUPE_NODE", "0"));
    o.nodes = std::stoi(env_or("TROUPE_NODES", "1"));
    o.nodes_per_host = std::stoi(env_or("TROUPE_NODES_PER_HOST", "1"));
    o.local_node = std::stoi(env_or("TROUPE_LOCAL_NODE", "0"));
    if (o.local_node < 0) throw std::invalid_argument("TROUPE_LOCAL_NODE must be 0 or more");
    o.join_timeout = std::chrono::milliseconds(std::stoi(env_or("TROUPE_JOIN_TIMEOUT_MS", "60000")));
    const auto coord = env_or("TROUPE_COORDINATOR", "127.0.0.1:0");
    const auto colon = coord.rfind(':');
    if (colon == std::string::npos) throw std::invalid_argument("TROUPE_COORDINATOR must be host:port");
    o.host = coord.substr(0, colon);
    o.port = static_cast<std::uint16_t>(std::stoi(coord.substr(colon + 1)));
    const double probe_s = std::stod(env_or("TROUPE_CLOCK_PROBE_SECONDS", "10"));
    if (!(probe_s >= 0)) throw std::invalid_argument("TROUPE_CLOCK_PROBE_SECONDS must be 0 or more seconds");
    o.clock_probe_interval = std::chrono::milliseconds(std::int64_t(probe_s * 1000));
    o.clock_drift_ppm = std::stod(env_or("TROUPE_TEST_CLOCK_DRIFT_PPM", "0"));  // tests: a clock at another rate
    o.run.launch = read_environment();
  } catch (const std::exception& e) {
    return fail(exit_usage, std::string("bad node environment: ") + e.what());
  }
  o.token = env_or("TROUPE_JOB_TOKEN", "");
  o.rejoin = env_or("TROUPE_REJOIN", "0") == "1";  // the launcher restarted this lost node
  o.run.node_restarts = std::max(0, std::atoi(env_or("TROUPE_NODE_RESTARTS", "0").c_str()));
  o.run.final_state = false;  // nothing here reads it: --save and checkpoint_dir gather what they write
  o.version = std::stoi(env_or("TROUPE_PROTOCOL_VERSION", "0"));  // tests: present another version
  o.clock_skew_ns = std::stoll(env_or("TROUPE_TEST_CLOCK_SKEW_MS", "0")) * 1000000;  // tests: another machine's clock
  o.tls_certificate = env_or("TROUPE_TLS_CERT", "");
  o.tls_key = env_or("TROUPE_TLS_KEY", "");
  o.tls_cafile = env_or("TROUPE_TLS_CA", "");
  o.transport = {env_or("TROUPE_STAGE_THROUGH_HOST", ""), env_or("TROUPE_IPC", ""), env_or("TROUPE_NCCL", ""),
                 env_or("TROUPE_LINKS", "")};
  if (o.token.empty()) return fail(exit_usage, "TROUPE_JOB_TOKEN is not set (the launcher sets it: launch/troupe train --nodes N)");
  if (o.node == 0) {
    try {
      o.cfg = flags.load();
    } catch (const troupe::config_error& e) {
      return fail(exit_usage, e.what());
    }
    // "auto" is decided once, here, for every node: the GPUs when node 0 has one (each
    // node then takes a GPU of its machine, node_device), else the CPU. A node of another
    // machine without a GPU then fails before it is ready, with the reason, and ends the job.
    if (o.nodes > 1 && o.cfg.device == "auto") o.cfg.device = troupe::cuda_usable() ? "cuda" : "cpu";
  }
  install_stop_handlers(o.node == 0);
  try {
    const auto result = troupe::run_node(o);
    if (result.exit_code != 0) return run_ended(result.exit_code, result.error);
    return 0;
  } catch (const troupe::config_error& e) {
    return fail(exit_usage, e.what());
  } catch (const std::exception& e) {
    return fail(1, e.what());
  }
}

}  // namespace troupe_cli
