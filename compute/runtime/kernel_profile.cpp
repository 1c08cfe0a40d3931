#include "compute/runtime/kernel_profile.hpp"

#include <cstdlib>
#include <stdexcept>

#include <torch/version.h>

#if defined(TROUPE_TORCH_CUDA) && TORCH_VERSION_MAJOR >= 2
#define TROUPE_KERNEL_PROFILER 1
#include <condition_variable>
#include <mutex>
#include <thread>

#include <torch/csrc/autograd/profiler_kineto.h>
#endif

namespace troupe {

std::optional<kernel_profile_request> parse_kernel_profile(const std::string& request) {
  if (request.empty()) return std::nullopt;
  kernel_profile_request r;
  std::string s = request;
  const auto bad = [&] {
    return std::invalid_argument("TROUPE_KERNEL_PROFILE=" + request +
                                 ": expected FILE[:FIRST[:LAST]] with 0 <= FIRST <= LAST (steps, 0-based)");
  };
  const auto number = [&](const std::string& t) {
    std::size_t used = 0;
    int n = -1;
    try {
      n = std::stoi(t, &used);
    } catch (const std::exception&) {
      throw bad();
    }
    if (used != t.size() || n < 0) throw bad();
    return n;
  };
  const auto c1 = s.find(':');
  r.path = s.substr(0, c1);
  if (c1 != std::string::npos) {
    const auto c2 = s.find(':', c1 + 1);
    r.first = number(s.substr(c1 + 1, c2 == std::string::npos ? std::string::npos : c2 - c1 - 1));
    r.last = c2 == std::string::npos ? r.first : number(s.substr(c2 + 1));
  }
  if (r.path.empty() || r.last < r.first) throw bad();
  return r;
}

void check_kernel_profile(const std::string& request) {
  if (parse_kernel_profile(request) && !kernel_profile::available())
    throw std::invalid_argument(
        "TROUPE_KERNEL_PROFILE is set, but this build has no kernel profiler (it needs LibTorch 2.x with CUDA)");
}

#ifdef TROUPE_KERNEL_PROFILER
// The Kineto profiler's state is the enabling thread's: one thread enables, waits, then
// disables and saves, whichever threads ask.
struct kernel_profile::impl {
  std::mutex mu;
  std::condition_variable cv;
  bool stop_asked = false, started = false;
  std::string path, error;
  std::thread worker;

  void run() {
    namespace ap = torch::autograd::profiler;
    namespace pi = torch::profiler::impl;
    const pi::ProfilerConfig config(pi::ProfilerState::KINETO);
    const std::set<pi::ActivityType> activities{pi::ActivityType::CPU, pi::ActivityType::CUDA};
    std::unique_lock<std::mutex> lock(mu);
    try {
      ap::prepareProfiler(config, activities);
      ap::enableProfiler(config, activities);
    } catch (const std::exception& e) {
      error = e.what();
    }
    started = true;
    cv.notify_all();
    if (!error.empty()) return;
    cv.wait(lock, [&] { return stop_asked; });
    try {
      auto result = ap::disableProfiler();
      if (!path.empty()) result->save(path);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
};

bool kernel_profile::available() { return true; }
kernel_profile::kernel_profile() : impl_(std::make_unique<impl>()) {}
kernel_profile::~kernel_profile() {
  if (running()) {
    {
      std::lock_guard<std::mutex> lock(impl_->mu);
      impl_->stop_asked = true;
    }
    impl_->cv.notify_all();
    impl_->worker.join();
  }
}

void kernel_profile::start() {
  if (running()) return;
  impl_->worker = std::thread([this] { impl_->run(); });
  std::unique_lock<std::mutex> lock(impl_->mu);
  impl_->cv.wait(lock, [&] { return impl_->started; });
  if (!impl_->error.empty()) {
    lock.unlock();
    impl_->worker.join();
    throw std::runtime_error("kernel profile: " + impl_->error);
  }
}

void kernel_profile::stop(const std::string& path) {
  if (!running()) return;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->path = path;
    impl_->stop_asked = true;
  }
  impl_->cv.notify_all();
  impl_->worker.join();
  if (!impl_->error.empty()) throw std::runtime_error("kernel profile: " + impl_->error);
}

bool kernel_profile::running() const { return impl_->worker.joinable(); }
#else
struct kernel_profile::impl {};
bool kernel_profile::available() { return false; }
kernel_profile::kernel_profile() = default;
kernel_profile::~kernel_profile() = default;
void kernel_profile::start() {
  throw std::runtime_error(
      "kernel profile (TROUPE_KERNEL_PROFILE): this build has no kernel profiler (it needs LibTorch 2.x with CUDA)");
}
void kernel_profile::stop(const std::string&) {}
bool kernel_profile::running() const { return false; }
#endif

}  // namespace troupe
