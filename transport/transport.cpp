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

work_ptr communicator::all_to_all(torch::Tensor input, const std::vector<std::int64_t>& send_counts,
                                  torch::Tensor output, const std::vector<std::int64_t>& recv_counts) {
  const int n = size(), me = rank();
  if (int(send_counts.size()) != n || int(recv_counts.size()) != n)
    throw std::invalid_argument("all_to_all: " + std::to_string(send_counts.size()) + " send and " +
                                std::to_string(recv_counts.size()) + " receive counts for " + std::to_string(n) + " ranks");
  std::int64_t sent = 0, received = 0;
  for (int r = 0; r < n; ++r) {
    if (send_counts[r] < 0 || recv_counts[r] < 0) throw std::invalid_argument("all_to_all: a negative count");
    sent += send_counts[r];
    received += recv_counts[r];
  }
  check_tensor(input, sent, "all_to_all input", true);
  check_tensor(output, received, "all_to_all output", true);
  input = input.view({-1});
  output = output.view({-1});
  if (input.scalar_type() != output.scalar_type()) throw std::invalid_argument("all_to_all: input and output dtypes differ");
  if (send_counts[me] != recv_counts[me])
    throw std::invalid_argument("all_to_all: sends " + std::to_string(send_counts[me]) + " elements to itself, receives " +
                                std::to_string(recv_counts[me]));
  const std::uint32_t tag = all_to_all_tag + (all_to_alls_++ & 0xFFFFFu);
  std::vector<work_ptr> parts;
  std::int64_t in_at = 0, out_at = 0;
  for (int r = 0; r < n; ++r) {
    const auto in = input.narrow(0, in_at, send_counts[r]), out = output.narrow(0, out_at, recv_counts[r]);
    in_at += send_counts[r];
    out_at += recv_counts[r];
    if (r == me) {
      out.copy_(in);
      continue;
    }
    if (recv_counts[r] > 0) parts.push_back(recv(out, r, tag));
    if (send_counts[r] > 0) parts.push_back(send(in, r, tag));
  }
  return all_of(std::move(parts), "all_to_all #" + std::to_string(tag - all_to_all_tag) + " (rank " +
                                      std::to_string(me) + ")");
}

work_ptr all_of(std::vector<work_ptr> parts, const std::string& what) {
  auto outer = std::make_shared<work>(what);
  if (parts.empty()) {
    outer->complete();
    return outer;
  }
  struct state {
    std::mutex mu;
    std::size_t left;
    std::string error;
  };
  auto st = std::make_shared<state>();
  st->left = parts.size();
  outer->set_abort_hook([parts] {
    for (const auto& p : parts) p->abort("aborted");
  });
  for (const auto& p : parts)
    p->on_complete([st, outer](const std::string& err) {
      std::string error;
      {
        std::lock_guard<std::mutex> lk(st->mu);
        if (!err.empty() && st->error.empty()) st->error = err;
        if (--st->left != 0) return;
        error = st->error;
      }
      outer->complete(error);
    });
  return outer;
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
