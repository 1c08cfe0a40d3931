#include "transport/host_staging.hpp"

#include <mutex>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "transport/caller_stream.hpp"

namespace troupe::transport {

namespace {

class staged_comm final : public communicator {
 public:
  staged_comm(std::shared_ptr<communicator> inner, torch::Device target, bool always)
      : inner_(std::move(inner)), target_(target), always_(always) {}

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string backend() const override {
    return inner_->backend() + (target_.is_cpu() ? " (staged through host memory)"
                                                 : " (tensors elsewhere staged through " + target_.str() + ")");
  }

  work_ptr send(torch::Tensor t, int dst, std::uint32_t tag) override {
    if (!staged(t, "send")) return inner_->send(std::move(t), dst, tag);
    auto buf = staged_copy(t);
    return outer(inner_->send(buf, dst, tag), {}, {buf});
  }
  work_ptr recv(torch::Tensor t, int src, std::uint32_t tag) override {
    if (!staged(t, "recv")) return inner_->recv(std::move(t), src, tag);
    auto buf = staging_buffer(t);
    return outer(inner_->recv(buf, src, tag), {{t, buf}}, {});
  }
  work_ptr all_reduce(torch::Tensor t) override {
    if (!staged(t, "all_reduce")) return inner_->all_reduce(std::move(t));
    auto buf = staged_copy(t);
    return outer(inner_->all_reduce(buf), {{t, buf}}, {});
  }
  work_ptr reduce_scatter(torch::Tensor input, torch::Tensor output) override {
    const bool in = staged(input, "reduce_scatter input"), out = staged(output, "reduce_scatter output");
    if (!in && !out) return inner_->reduce_scatter(std::move(input), std::move(output));
    auto hin = in ? staged_copy(input) : input, hout = out ? staging_buffer(output) : output;
    return outer(inner_->reduce_scatter(hin, hout), out ? copies{{output, hout}} : copies{}, {hin});
  }
  work_ptr all_gather(torch::Tensor input, torch::Tensor output) override {
    // An input inside the output (in place) is copied out before anything is written.
    const bool in = staged(input, "all_gather input"), out = staged(output, "all_gather output");
    if (!in && !out) return inner_->all_gather(std::move(input), std::move(output));
    auto hin = in ? staged_copy(input) : input, hout = out ? staging_buffer(output) : output;
    return outer(inner_->all_gather(hin, hout), out ? copies{{output, hout}} : copies{}, {hin});
  }
  work_ptr broadcast(torch::Tensor t, int root) override {
    if (!staged(t, "broadcast")) return inner_->broadcast(std::move(t), root);
    auto buf = staged_copy(t);
    return outer(inner_->broadcast(buf, root), rank() == root ? copies{} : copies{{t, buf}}, {});
  }
  void abort(const std::string& why) override { inner_->abort(why); }

 private:
  using copies = std::vector<std::pair<torch::Tensor, torch::Tensor>>;  // (caller's tensor, staging buffer)

  /// True when `t` goes through a copy on the target device (checked first: a bad tensor
  /// is the caller's error before anything is copied).
  bool staged(const torch::Tensor& t, const char* what) const {
    check_tensor(t, -1, what, /*any_device=*/true);
    return always_ || t.device() != target_;
  }
  /// Memory on the target for `t`'s bytes; on the host, page-locked for a GPU tensor
  /// (copies at the bus's speed, from LibTorch's caching host allocator; as gloo stages
  /// CUDA tensors).
  torch::Tensor staging_buffer(const torch::Tensor& t) const {
    return torch::empty(t.sizes(), t.options().device(target_).pinned_memory(target_.is_cpu() && t.is_cuda()));
  }
  torch::Tensor staged_copy(const torch::Tensor& t) const {
    if (t.device() == target_) return t.clone();
    auto h = staging_buffer(t);
    h.copy_(t);  // blocking: after the kernels queued on the current stream
    return h;
  }

  /// The caller's work for `inner`: completes after the staging buffers are copied back
  /// into the caller's tensors; keeps `keep` (staged inputs) alive until the transfers are done.
  /// The copies back run on the caller's stream at the call (GPU tensors; called on the
  /// caller's thread): after the kernels it had queued there, which may still use the
  /// memory of a tensor just allocated (caller_stream.hpp); the completing thread's own
  /// stream would not wait for them.
  static work_ptr outer(const work_ptr& inner, copies back, std::vector<torch::Tensor> keep) {
    const auto stream = back.empty() ? c10::nullopt : caller_stream_of(back.front().first);
    auto w = std::make_shared<work>(inner->what());
    struct guard {
      std::mutex mu;
      bool aborted = false;
    };
    auto g = std::make_shared<guard>();
    // Aborted by its caller: no copy back after abort() returns, and the caller's reason
    // is the error (the inner work fails with its own, which is not passed on).
    w->set_abort_hook([g, inner] {
      {
        std::lock_guard<std::mutex> lock(g->mu);
        g->aborted = true;
      }
      inner->abort("its caller aborted the staged work");
    });
    inner->on_complete([w, g, back = std::move(back), keep = std::move(keep), stream](const std::string& err) {
      std::string error = err;
      {
        std::lock_guard<std::mutex> lock(g->mu);
        if (g->aborted) return;
        if (error.empty()) {
          try {
            c10::OptionalStreamGuard on(stream);
            for (const auto& [dst, buf] : back) dst.copy_(buf);  // blocking copy back (synchronises `stream`)
          } catch (const std::exception& e) {
            error = std::string("copying the result back from the staging buffer: ") + e.what();
          }
        }
      }
      w->complete(error);
    });
    return w;
  }

  std::shared_ptr<communicator> inner_;
  torch::Device target_;
  bool always_;
};

}  // namespace

std::shared_ptr<communicator> stage_through_host(std::shared_ptr<communicator> inner, bool always) {
  return std::make_shared<staged_comm>(std::move(inner), torch::kCPU, always);
}

std::shared_ptr<communicator> stage_through_device(std::shared_ptr<communicator> inner, torch::Device device) {
  if (device.is_cuda() && !device.has_index())
    throw std::invalid_argument("stage_through_device: name the GPU (cuda:N), not " + device.str());
  return std::make_shared<staged_comm>(std::move(inner), device, false);
}

}  // namespace troupe::transport
