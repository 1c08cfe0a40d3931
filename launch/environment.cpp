#include "launch/environment.hpp"

#include <sys/prctl.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <stdexcept>

#include <spdlog/cfg/env.h>
#include <spdlog/spdlog.h>

#include "compute/config/job_config.hpp"
#include "compute/data/tokenizer.hpp"

namespace troupe_cli {

std::string env_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v && *v ? v : fallback;
}

void end_with_launcher() {
  const auto launcher = env_or("TROUPE_LAUNCHER_PID", "");
  if (launcher.empty()) return;
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  // (Checked after the request: a launcher that died just before it is seen here.)
  if (std::to_string(::getppid()) != launcher) {
    std::fprintf(stderr, "troupe: error: its launcher (pid %s) has ended: not starting\n", launcher.c_str());
    std::_Exit(1);
  }
}

namespace {

/// `name`'s value as a number; nullopt when unset or empty.
std::optional<double> number(const char* name) {
  const auto v = env_or(name, "");
  if (v.empty()) return std::nullopt;
  try {
    std::size_t used = 0;
    const double x = std::stod(v, &used);
    if (used == v.size()) return x;
  } catch (const std::exception&) {
  }
  throw troupe::config_error(std::string(name) + " must be a number, not '" + v + "'");
}

}  // namespace

troupe::launch_info launch_info_from_environment() {
  troupe::launch_info l;
  l.attempt = int(number("TROUPE_LAUNCH_ATTEMPT").value_or(0));
  l.resume_auto = env_or("TROUPE_RESUME_AUTO", "") == "1";
  l.failed_at = number("TROUPE_FAILED_AT");
  l.regrow_at = number("TROUPE_REGROW_AT");
  l.backward_on_stage_threads = env_or("TROUPE_BACKWARD_ON_STAGE_THREAD", "") == "1";
  l.blocking_input_copies = env_or("TROUPE_BLOCKING_INPUT_COPIES", "") == "1";
  l.all_to_all_delay = std::chrono::microseconds(std::int64_t(number("TROUPE_TEST_ALLTOALL_DELAY_MS").value_or(0) * 1000));
  l.kernel_profile = env_or("TROUPE_KERNEL_PROFILE", "");
  return l;
}

troupe::transport::ucx_options ucx_options_from(const char* spin, const char* tls) {
  troupe::transport::ucx_options o;
  if (spin && *spin) {
    try {
      std::size_t used = 0;
      o.spin = std::max(0, std::stoi(spin, &used));
      if (used != std::string(spin).size()) throw std::invalid_argument(spin);
    } catch (const std::exception&) {
      throw troupe::config_error(std::string("TROUPE_UCX_SPIN must be a count, not '") + spin + "'");
    }
  }
  if (tls) o.tls = tls;
  return o;
}

std::string cache_dir_from(const char* xdg_cache_home, const char* home) {
  namespace fs = std::filesystem;
  if (xdg_cache_home && *xdg_cache_home) return (fs::path(xdg_cache_home) / "troupe").string();
  if (home && *home) return (fs::path(home) / ".cache" / "troupe").string();
  return "";
}

const troupe::launch_info& read_environment() {
  static const troupe::launch_info read = [] {
    troupe::transport::set_process_ucx_options(ucx_options_from(std::getenv("TROUPE_UCX_SPIN"), std::getenv("UCX_TLS")));
    troupe::set_default_cache_dir(cache_dir_from(std::getenv("XDG_CACHE_HOME"), std::getenv("HOME")));
    spdlog::cfg::load_env_levels();  // SPDLOG_LEVEL=debug: the debug lines too (every actor's wait in a hang)
    return launch_info_from_environment();
  }();
  return read;
}

}  // namespace troupe_cli
