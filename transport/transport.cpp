#include "transport/transport.hpp"

#include <torch/torch.h>

namespace troupe::transport {

bool work::wait(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_for(lock, timeout, [this] { return done_; })) return false;
  if (!error_.empty()) throw transport_error(what_ + ": " + error_);
  return true;
}

void work::wait_or_throw(std::chrono::milliseconds timeout) {
  if (!wait(timeout))
    throw transport_error(what_ + ": timed out after " + std::to_string(timeout.count()) + " ms");
}

bool work::done() const {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

std::string work::error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

void work::on_complete(callback cb) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!done_) {
    callbacks_.push_back(std::move(cb));
    return;
  }
  auto err = error_;
  lock.unlock();
  cb(err);
}

void work::set_abort_hook(std::function<void()> hook) {
  std::lock_guard<std::mutex> lock(mu_);
  abort_hook_ = std::move(hook);
}

void work::abort(const std::string& why) {
  std::function<void()> hook;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) return;
    hook = std::move(abort_hook_);
  }
  if (hook) hook();
  complete("aborted: " + why);
}

void work::complete(std::string error) {
  std::vector<callback> cbs;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) return;
    done_ = true;
    error_ = std::move(error);
    cbs.swap(callbacks_);
    abort_hook_ = nullptr;
  }
  cv_.notify_all();
  for (auto& cb : cbs) cb(error_);
}

std::pair<std::int64_t, std::int64_t> piece(std::int64_t n, int parts, int i) {
  const std::int64_t base = n / parts, extra = n % parts;
  const std::int64_t begin = i * base + std::min<std::int64_t>(i, extra);
  return {begin, begin + base + (i < extra ? 1 : 0)};
}

const char* collective_name(collective c) {
  switch (c) {
    case collective::all_reduce: return "all_reduce";
    case collective::reduce_scatter: return "reduce_scatter";
    case collective::all_gather: return "all_gather";
    case collective::broadcast: return "broadcast";
  }
  return "unknown collective";
}

void check_tensor(const torch::Tensor& t, std::int64_t numel, const char* what, bool any_device) {
  if (!t.defined()) throw std::invalid_argument(std::string(what) + ": undefined tensor");
  if (!any_device && !t.device().is_cpu()) throw std::invalid_argument(std::string(what) + ": not a CPU tensor");
  if (!t.is_contiguous()) throw std::invalid_argument(std::string(what) + ": not contiguous");
  if (numel >= 0 && t.numel() != numel)
    throw std::invalid_argument(std::string(what) + ": " + std::to_string(t.numel()) + " elements, expected " +
                                std::to_string(numel));
}

bool summable(torch::ScalarType t) {
  return t == torch::kFloat32 || t == torch::kFloat64 || t == torch::kInt32 || t == torch::kInt64;
}

void ring_order_sum(torch::Tensor out, const std::vector<torch::Tensor>& by_rank, int i) {
  const int n = int(by_rank.size());
  out.copy_(by_rank[(i + 1) % n]);
  for (int k = 2; k <= n; ++k) out.add_(by_rank[(i + k) % n]);
}

}  // namespace troupe::transport
