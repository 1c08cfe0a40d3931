#pragma once
// The environment of a troupe process, read once by its main: what launch/troupe and the
// benchmarks set (TROUPE_*), and UCX's transports. Nothing below launch/ reads an
// environment variable; these structs carry what was read (actors/launch_info.hpp,
// transport::ucx_options).
#include <string>

#include "actors/launch_info.hpp"
#include "transport/ucx/ucx_communicator.hpp"

namespace troupe_cli {

/// `name`'s value, or `fallback` when it is unset or empty.
std::string env_or(const char* name, const std::string& fallback);

/// TROUPE_LAUNCH_ATTEMPT, TROUPE_RESUME_AUTO, TROUPE_FAILED_AT, TROUPE_REGROW_AT,
/// TROUPE_BACKWARD_ON_STAGE_THREAD, TROUPE_TEST_ALLTOALL_DELAY_MS, TROUPE_KERNEL_PROFILE.
/// Throws troupe::config_error naming a variable whose value is not a number.
troupe::launch_info launch_info_from_environment();

/// The UCX communicators' options from TROUPE_UCX_SPIN (`spin`, "" or null: unset) and
/// UCX_TLS (`tls`). Throws troupe::config_error for a spin that is not a count.
troupe::transport::ucx_options ucx_options_from(const char* spin, const char* tls);

/// The token cache's default folder: $XDG_CACHE_HOME/troupe, else $HOME/.cache/troupe
/// ("" where neither is set).
std::string cache_dir_from(const char* xdg_cache_home, const char* home);

/// A process that launch/troupe started on its own machine (TROUPE_LAUNCHER_PID: the
/// launcher's shell) ends with it, however the launcher ends (SIGKILL too): the kernel
/// sends this process SIGKILL when its parent dies (PR_SET_PDEATHSIG). A launcher already
/// gone ends it at once (status 1). Without the variable: nothing.
void end_with_launcher();

/// Reads the environment once (the first call; a malformed value throws config_error on
/// every call): installs the UCX options for every communicator of this process
/// (transport::set_process_ucx_options), the token cache's default folder
/// (troupe::set_default_cache_dir) and the log level (SPDLOG_LEVEL, spdlog's
/// load_env_levels: `debug` adds the debug lines); returns the launch_info.
const troupe::launch_info& read_environment();

}  // namespace troupe_cli
