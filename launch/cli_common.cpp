#include "launch/cli_common.hpp"

#include <csignal>
#include <cstdio>
#include <cstdlib>

#include "actors/runtime.hpp"
#include "compute/trainer/local_trainer.hpp"

namespace {

extern "C" void on_stop_signal(int sig) {
  troupe::request_stop(sig);
  std::signal(sig, sig == SIGUSR1 ? SIG_IGN : SIG_DFL);  // a second SIGTERM ends the process at once
}

extern "C" void on_status_signal(int) { troupe::request_status(); }

}  // namespace

namespace troupe_cli {

int fail(int code, const std::string& msg) {
  std::fprintf(stderr, "troupe: error: %s\n", msg.c_str());
  return code;
}

int run_ended(int code, const std::string& msg) {
  if (code != troupe::exit_stopped) return fail(code, msg);
  std::fprintf(stderr, "troupe: %s\n", msg.c_str());
  return code;
}

void install_stop_handlers(bool coordinator) {
  if (coordinator) {
    std::signal(SIGTERM, on_stop_signal);
    std::signal(SIGUSR1, on_stop_signal);
    std::signal(SIGUSR2, on_status_signal);
  } else {
    std::signal(SIGUSR1, SIG_IGN);
    std::signal(SIGUSR2, SIG_IGN);
  }
}

}  // namespace troupe_cli
