#pragma once
// Starts N processes in a process group of their own, waits for all with a deadline and
// kills the whole group when the deadline passes or the object goes away, so that no test
// leaves processes behind, passing or failing.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace troupe::test {

class process_group {
 public:
  struct result {
    int status = -1;  ///< exit status, 128 + signal, or -1 when killed at the deadline
    std::string output;
  };

  /// `argv_of(i)` gives process i's arguments (argv[0] = program path); `env` entries
  /// ("NAME=value") are added to this process's environment.
  template <class ArgvOf>
  process_group(int n, ArgvOf argv_of, const std::vector<std::string>& env, const std::string& log_dir)
      : process_group(n, argv_of, [&](int) { return env; }, log_dir, 0) {}

  /// The same with an environment per process: `env_of(i)`, and where `cwds` is given, a
  /// working folder per process.
  template <class ArgvOf, class EnvOf>
  process_group(int n, ArgvOf argv_of, EnvOf env_of, const std::string& log_dir, int /*per-process env*/,
                const std::vector<std::string>& cwds = {}) {
    for (int i = 0; i < n; ++i) {
      std::vector<std::string> envs;
      for (char** e = environ; *e; ++e) envs.emplace_back(*e);
      for (const auto& e : env_of(i)) envs.push_back(e);
      std::vector<char*> envp;
      for (auto& e : envs) envp.push_back(e.data());
      envp.push_back(nullptr);
      std::vector<std::string> args = argv_of(i);
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      logs_.push_back(log_dir + "/proc-" + std::to_string(i) + ".log");
      posix_spawn_file_actions_t fa;
      posix_spawn_file_actions_init(&fa);
      posix_spawn_file_actions_addopen(&fa, 1, logs_.back().c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      posix_spawn_file_actions_adddup2(&fa, 1, 2);
      if (!cwds.empty()) posix_spawn_file_actions_addchdir_np(&fa, cwds.at(i).c_str());
      posix_spawnattr_t attr;
      posix_spawnattr_init(&attr);
      posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);
      posix_spawnattr_setpgroup(&attr, pgid_);  // 0 for the first: it leads the group
      pid_t pid = 0;
      const int rc = posix_spawn(&pid, argv[0], &fa, &attr, argv.data(), envp.data());
      posix_spawn_file_actions_destroy(&fa);
      posix_spawnattr_destroy(&attr);
      if (rc != 0) {
        kill_all();
        throw std::runtime_error("cannot start " + args[0]);
      }
      if (pgid_ == 0) pgid_ = pid;
      pids_.push_back(pid);
    }
  }
  ~process_group() { kill_all(); }

  /// Process i's output so far.
  std::string log(int i) const {
    std::ifstream in(logs_.at(i));
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }
  /// Sends `sig` to process i.
  void signal(int i, int sig) { ::kill(pids_.at(i), sig); }
  /// Waits up to `timeout` for `pred(log(i))` to hold.
  template <class Pred>
  bool wait_for_log(int i, Pred pred, std::chrono::seconds timeout) const {
    const auto until = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < until) {
      if (pred(log(i))) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return false;
  }

  /// Waits for every process until `deadline`; then kills the group.
  std::vector<result> wait(std::chrono::seconds deadline) {
    std::vector<result> out(pids_.size());
    std::vector<bool> done(pids_.size(), false);
    const auto until = std::chrono::steady_clock::now() + deadline;
    std::size_t left = pids_.size();
    while (left > 0 && std::chrono::steady_clock::now() < until) {
      for (std::size_t i = 0; i < pids_.size(); ++i) {
        if (done[i]) continue;
        int st = 0;
        if (waitpid(pids_[i], &st, WNOHANG) == pids_[i]) {
          done[i] = true;
          --left;
          out[i].status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        }
      }
      if (left > 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    kill_all();  // the stragglers (reaped there)
    for (std::size_t i = 0; i < out.size(); ++i) {
      std::ifstream in(logs_[i]);
      std::stringstream ss;
      ss << in.rdbuf();
      out[i].output = ss.str();
    }
    return out;
  }

 private:
  void kill_all() {
    if (pgid_ > 0 && !pids_.empty()) ::kill(-pgid_, SIGKILL);
    for (auto pid : pids_) waitpid(pid, nullptr, 0);
    pids_.clear();
  }
  pid_t pgid_ = 0;
  std::vector<pid_t> pids_;
  std::vector<std::string> logs_;
};

}  // namespace troupe::test
