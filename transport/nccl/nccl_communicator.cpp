#include "transport/nccl/nccl_communicator.hpp"

#ifdef TROUPE_HAVE_NCCL
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "transport/cuda_stream.hpp"
#endif

namespace troupe::transport {

#ifndef TROUPE_HAVE_NCCL

bool nccl_built() { return false; }
std::vector<char> nccl_unique_id() {
  throw transport_error("this build has no NCCL backend (no CUDA toolkit with NCCL was found)");
}
std::shared_ptr<communicator> make_nccl_communicator(const std::vector<char>&, int, int, int, nccl_options) {
  throw transport_error("this build has no NCCL backend (no CUDA toolkit with NCCL was found)");
}
std::shared_ptr<ordered_link> make_nccl_link(const std::vector<char>&, bool, int, nccl_options) {
  throw transport_error("this build has no NCCL backend (no CUDA toolkit with NCCL was found)");
}

#else

namespace {

using clock = std::chrono::steady_clock;

std::string cuda_text(cudaError_t e) { return cudaGetErrorString(e); }

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw transport_error(std::string("nccl backend: ") + what + ": " + cuda_text(e));
}

/// NCCL's type for summing `t`'s dtype; throws for dtypes NCCL cannot sum.
ncclDataType_t sum_type(torch::ScalarType t) {
  switch (t) {
    case torch::kFloat32: return ncclFloat32;
    case torch::kFloat64: return ncclFloat64;
    case torch::kBFloat16: return ncclBfloat16;
    case torch::kHalf: return ncclFloat16;
    case torch::kInt32: return ncclInt32;
    case torch::kInt64: return ncclInt64;
    default: throw std::invalid_argument(std::string("nccl: cannot sum dtype ") + c10::toString(t));
  }
}

class nccl_communicator final : public communicator {
 public:
  nccl_communicator(const std::vector<char>& id, int rank, int size, int device, nccl_options opts)
      : rank_(rank), size_(size), device_(device), opts_(opts) {
    if (id.size() != sizeof(ncclUniqueId))
      throw transport_error("nccl: a unique id has " + std::to_string(sizeof(ncclUniqueId)) + " bytes, not " +
                            std::to_string(id.size()));
    ncclUniqueId uid;
    std::memcpy(&uid, id.data(), sizeof uid);
    check_cuda(cudaSetDevice(device), "cudaSetDevice");
    check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;  // creation and operations return at once: they can be timed out
    const auto r = ncclCommInitRankConfig(&comm_, size, uid, rank, &cfg);
    std::string err = r == ncclSuccess || r == ncclInProgress ? settle() : ncclGetErrorString(r);
    if (!err.empty()) {
      if (comm_) ncclCommAbort(comm_);
      cudaStreamDestroy(stream_);
      throw transport_error("nccl: rank " + std::to_string(rank) + " of " + std::to_string(size) + " on GPU " +
                            std::to_string(device) + ": creating the communicator: " + err);
    }
    poller_ = std::thread([this] { poll(); });
  }

  ~nccl_communicator() override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    poller_.join();
    fail_all("communicator closed");  // aborts it (frees NCCL's resources) if still healthy
    // stream_ stays: tensors used on it (cuda::used_on) may be freed later, and LibTorch's
    // caching allocator then records an event on it (see ipc/cuda_memory.cpp).
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "nccl"; }

  work_ptr send(torch::Tensor t, int dst, std::uint32_t) override {
    check(t, -1, "send");
    peer(dst, "send");
    return enqueue("nccl send", {t}, [&](cudaStream_t s) {
      return ncclSend(t.data_ptr(), t.nbytes(), ncclInt8, dst, comm_, s);
    });
  }
  work_ptr recv(torch::Tensor t, int src, std::uint32_t) override {
    check(t, -1, "recv");
    peer(src, "recv");
    return enqueue("nccl recv", {t}, [&](cudaStream_t s) {
      return ncclRecv(t.data_ptr(), t.nbytes(), ncclInt8, src, comm_, s);
    });
  }
  work_ptr all_reduce(torch::Tensor t) override {
    check(t, -1, "all_reduce");
    const auto type = sum_type(t.scalar_type());
    return enqueue("nccl all_reduce", {t}, [&](cudaStream_t s) {
      return ncclAllReduce(t.data_ptr(), t.data_ptr(), t.numel(), type, ncclSum, comm_, s);
    });
  }
  work_ptr reduce_scatter(torch::Tensor input, torch::Tensor output) override {
    check(input, -1, "reduce_scatter input");
    equal_pieces(input.numel(), "reduce_scatter");
    check(output, input.numel() / size_, "reduce_scatter output");
    const auto type = sum_type(input.scalar_type());
    if (output.scalar_type() != input.scalar_type()) throw std::invalid_argument("nccl reduce_scatter: dtypes differ");
    return enqueue("nccl reduce_scatter", {input, output}, [&](cudaStream_t s) {
      return ncclReduceScatter(input.data_ptr(), output.data_ptr(), output.numel(), type, ncclSum, comm_, s);
    });
  }
  work_ptr all_gather(torch::Tensor input, torch::Tensor output) override {
    check(output, -1, "all_gather output");
    equal_pieces(output.numel(), "all_gather");
    check(input, output.numel() / size_, "all_gather input");
    if (output.scalar_type() != input.scalar_type()) throw std::invalid_argument("nccl all_gather: dtypes differ");
    return enqueue("nccl all_gather", {input, output}, [&](cudaStream_t s) {
      return ncclAllGather(input.data_ptr(), output.data_ptr(), input.nbytes(), ncclInt8, comm_, s);
    });
  }
  work_ptr broadcast(torch::Tensor t, int root) override {
    check(t, -1, "broadcast");
    peer(root, "broadcast");
    return enqueue("nccl broadcast", {t}, [&](cudaStream_t s) {
      return ncclBroadcast(t.data_ptr(), t.data_ptr(), t.nbytes(), ncclInt8, root, comm_, s);
    });
  }

  /// One NCCL group of a send and a receive per rank with a count (this rank's own piece
  /// included: NCCL copies it), as PyTorch's ProcessGroupNCCL does.
  work_ptr all_to_all(torch::Tensor input, const std::vector<std::int64_t>& send_counts, torch::Tensor output,
                      const std::vector<std::int64_t>& recv_counts) override {
    check(input, -1, "all_to_all input");
    check(output, -1, "all_to_all output");
    if (output.scalar_type() != input.scalar_type()) throw std::invalid_argument("nccl all_to_all: dtypes differ");
    if (int(send_counts.size()) != size_ || int(recv_counts.size()) != size_)
      throw std::invalid_argument("nccl all_to_all: a count per rank expected (" + std::to_string(size_) + ")");
    std::int64_t sent = 0, received = 0;
    for (int r = 0; r < size_; ++r) {
      if (send_counts[r] < 0 || recv_counts[r] < 0) throw std::invalid_argument("nccl all_to_all: a negative count");
      sent += send_counts[r];
      received += recv_counts[r];
    }
    if (sent != input.numel() || received != output.numel())
      throw std::invalid_argument("nccl all_to_all: the counts sum to " + std::to_string(sent) + " / " +
                                  std::to_string(received) + " elements, the tensors hold " +
                                  std::to_string(input.numel()) + " / " + std::to_string(output.numel()));
    const auto bytes = static_cast<std::int64_t>(input.element_size());
    return enqueue("nccl all_to_all", {input, output}, [&](cudaStream_t s) {
      auto* in = static_cast<char*>(input.data_ptr());
      auto* out = static_cast<char*>(output.data_ptr());
      ncclResult_t r = ncclGroupStart();
      if (r != ncclSuccess) return r;
      std::int64_t at_in = 0, at_out = 0;
      for (int p = 0; p < size_ && r == ncclSuccess; ++p) {
        if (send_counts[p] > 0) r = ncclSend(in + at_in * bytes, send_counts[p] * bytes, ncclInt8, p, comm_, s);
        if (r == ncclSuccess && recv_counts[p] > 0)
          r = ncclRecv(out + at_out * bytes, recv_counts[p] * bytes, ncclInt8, p, comm_, s);
        at_in += send_counts[p];
        at_out += recv_counts[p];
      }
      const auto end = ncclGroupEnd();  // (a group started is ended, whatever happened in it)
      return r != ncclSuccess ? r : end;
    });
  }

  void abort(const std::string& why) override { fail_all(why); }

  /// For nccl_link: a send the caller's stream does not wait for (the tensor is kept
  /// from the caching allocator until it is sent), and a receive after `after`.
  work_ptr link_send(const torch::Tensor& t, int dst) {
    check(t, -1, "send");
    return enqueue(
        "nccl link send", {t}, [&](cudaStream_t s) { return ncclSend(t.data_ptr(), t.nbytes(), ncclInt8, dst, comm_, s); },
        nullptr, /*caller_waits=*/false);
  }
  work_ptr link_recv(const torch::Tensor& t, int src, cudaEvent_t after) {
    check(t, -1, "recv");
    return enqueue(
        "nccl link recv", {t}, [&](cudaStream_t s) { return ncclRecv(t.data_ptr(), t.nbytes(), ncclInt8, src, comm_, s); },
        after, /*caller_waits=*/false);
  }
  int device() const { return device_; }

 private:
  struct pending_op {
    work_ptr w;
    cudaEvent_t done;
    std::vector<torch::Tensor> keep;  // alive until the GPU is done with them
    clock::time_point start;
  };

  void check(const torch::Tensor& t, std::int64_t numel, const char* what) const {
    check_tensor(t, numel, what, /*any_device=*/true);
    if (!t.is_cuda() || t.device().index() != device_)
      throw std::invalid_argument(std::string("nccl ") + what + ": not a tensor on GPU " + std::to_string(device_));
  }
  void peer(int r, const char* what) const {
    if (r < 0 || r >= size_) throw std::invalid_argument(std::string("nccl ") + what + ": no rank " + std::to_string(r));
  }
  void equal_pieces(std::int64_t n, const char* what) const {
    if (n % size_ != 0)
      throw std::invalid_argument(std::string("nccl ") + what + ": " + std::to_string(n) +
                                  " elements do not split evenly over " + std::to_string(size_) + " ranks");
  }

  /// Waits while the non-blocking communicator reports ncclInProgress (bounded by the
  /// timeout); empty on success, else the error.
  std::string settle() {
    const auto deadline = clock::now() + opts_.timeout;
    for (;;) {
      ncclResult_t state = ncclSuccess;
      const auto r = ncclCommGetAsyncError(comm_, &state);
      if (r != ncclSuccess) return ncclGetErrorString(r);
      if (state == ncclSuccess) return {};
      if (state != ncclInProgress) return ncclGetErrorString(state);
      if (clock::now() > deadline)
        return "timed out after " + std::to_string(opts_.timeout.count()) + " ms (a rank did not join or answer)";
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }

  /// Runs `call` on the communicator's stream after what the caller queued so far on its
  /// current stream (or after `after`, an event recorded on the caller's thread earlier,
  /// where the call comes from another thread); the caller's stream waits for it in turn
  /// unless `caller_waits` is false (the caller learns of completion from the work).
  template <class Call>
  work_ptr enqueue(const char* what, std::vector<torch::Tensor> keep, Call&& call, cudaEvent_t after = nullptr,
                   bool caller_waits = true) {
    auto w = std::make_shared<work>(what);
    std::unique_lock<std::mutex> lk(mu_);  // one NCCL call at a time on this communicator
    if (!broken_.empty()) {
      lk.unlock();
      w->complete(broken_);
      return w;
    }
    cudaSetDevice(device_);
    const auto caller = cuda::caller_stream(device_);
    // The operation starts after what the caller queued so far ...
    cudaEvent_t ready = nullptr, done = nullptr;
    if (after) {
      cudaStreamWaitEvent(stream_, after, 0);
    } else {
      check_cuda(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), "cudaEventCreate");
      cudaEventRecord(ready, caller);
      cudaStreamWaitEvent(stream_, ready, 0);
      cudaEventDestroy(ready);
    }
    auto r = call(stream_);
    std::string err = r == ncclSuccess ? "" : r == ncclInProgress ? settle() : ncclGetErrorString(r);
    if (!err.empty()) {
      lk.unlock();
      fail_all(std::string(what) + ": " + err);
      w->complete(std::string(what) + ": " + err);
      return w;
    }
    // ... and what the caller queues next runs after it.
    check_cuda(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "cudaEventCreate");
    cudaEventRecord(done, stream_);
    if (caller_waits) cudaStreamWaitEvent(caller, done, 0);
    for (auto& t : keep) cuda::used_on(t, stream_, device_);
    pending_.push_back({w, done, std::move(keep), clock::now()});
    lk.unlock();
    cv_.notify_all();
    w->set_abort_hook([this] { fail_all("operation aborted"); });
    return w;
  }

  /// Completes finished operations; a NCCL error or an operation past the timeout
  /// aborts the communicator.
  void poll() {
    cudaSetDevice(device_);  // not GPU 0's context: this thread's CUDA calls are for this GPU
    std::unique_lock<std::mutex> lk(mu_);
    while (!stop_) {
      cv_.wait_for(lk, std::chrono::milliseconds(pending_.empty() ? 50 : 0), [&] { return stop_; });
      if (pending_.empty()) continue;
      std::vector<work_ptr> finished;
      std::string err;
      while (!pending_.empty()) {
        auto& op = pending_.front();
        const auto q = cudaEventQuery(op.done);
        if (q == cudaErrorNotReady) {
          if (clock::now() - op.start > opts_.timeout)
            err = std::string(op.w->what()) + ": timed out after " + std::to_string(opts_.timeout.count()) + " ms";
          break;
        }
        if (q != cudaSuccess) {
          err = std::string(op.w->what()) + ": " + cuda_text(q);
          break;
        }
        cudaEventDestroy(op.done);
        finished.push_back(std::move(op.w));
        pending_.pop_front();
      }
      ncclResult_t state = ncclSuccess;
      if (err.empty() && ncclCommGetAsyncError(comm_, &state) == ncclSuccess && state != ncclSuccess &&
          state != ncclInProgress)
        err = std::string("nccl: ") + ncclGetErrorString(state);
      lk.unlock();
      for (auto& w : finished) w->complete();
      if (!err.empty()) fail_all(err);
      if (pending_.empty() || !err.empty()) std::this_thread::yield();
      else std::this_thread::sleep_for(std::chrono::microseconds(50));
      lk.lock();
    }
  }

  /// Aborts the communicator (once) and fails every pending operation with `why`.
  void fail_all(const std::string& why) {
    std::deque<pending_op> failed;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (broken_.empty()) {
        broken_ = why;
        ncclCommAbort(comm_);  // stops kernels waiting for peers; frees the communicator
      }
      failed.swap(pending_);
    }
    for (auto& op : failed) {
      cudaEventDestroy(op.done);
      op.w->complete(why);
    }
  }

  const int rank_, size_, device_;
  const nccl_options opts_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<pending_op> pending_;
  std::string broken_;  // why the communicator was aborted (empty: healthy)
  bool stop_ = false;
  std::thread poller_;
};

/// What a link receive waits for: an event recorded on the caller's stream; and, where the
/// caller's tensor is not on the link's GPU, a tensor there to receive into.
struct nccl_fence final : link_fence {
  cudaEvent_t event = nullptr;
  torch::Tensor staging;
  ~nccl_fence() override {
    if (event) cudaEventDestroy(event);
  }
};

/// One direction of a pair of GPUs: a NCCL communicator of two ranks, rank 0 sends.
class nccl_link final : public ordered_link {
 public:
  nccl_link(const std::vector<char>& id, bool sender, int device, nccl_options opts)
      : sender_(sender), comm_(std::make_shared<nccl_communicator>(id, sender ? 0 : 1, 2, device, opts)) {}

  std::string backend() const override { return "nccl"; }

  work_ptr send(torch::Tensor t) override {
    if (!sender_) throw std::logic_error("nccl link: this end receives");
    check_tensor(t, -1, "nccl link send", /*any_device=*/true);
    if (!here(t)) t = t.to(gpu());  // staged on the caller's stream
    return comm_->link_send(t, 1);
  }

  std::shared_ptr<link_fence> fence(const torch::Tensor& t) override {
    auto f = std::make_shared<nccl_fence>();
    check_cuda(cudaSetDevice(comm_->device()), "cudaSetDevice");
    if (!here(t))
      f->staging = torch::empty({static_cast<std::int64_t>(t.nbytes())},
                                torch::TensorOptions().dtype(torch::kUInt8).device(gpu()));
    check_cuda(cudaEventCreateWithFlags(&f->event, cudaEventDisableTiming), "cudaEventCreate");
    check_cuda(cudaEventRecord(f->event, cuda::caller_stream(comm_->device())), "cudaEventRecord");
    return f;
  }

  work_ptr recv(torch::Tensor t, std::shared_ptr<link_fence> fence) override {
    if (sender_) throw std::logic_error("nccl link: this end sends");
    check_tensor(t, -1, "nccl link recv", /*any_device=*/true);
    auto f = std::dynamic_pointer_cast<nccl_fence>(fence);
    if (!f) f = std::static_pointer_cast<nccl_fence>(this->fence(t));
    if (!f->staging.defined()) return comm_->link_recv(t, 0, f->event);
    // Into the GPU, then out to the caller's tensor once the GPU has it (on the thread
    // that completes the work; the NCCL stream is done with the staging tensor by then).
    auto outer = std::make_shared<work>("nccl link recv (staged)");
    comm_->link_recv(f->staging, 0, f->event)
        ->on_complete([outer, t, staging = f->staging](const std::string& err) {
          std::string error = err;
          if (error.empty()) try {
              torch::from_blob(t.data_ptr(), {static_cast<std::int64_t>(t.nbytes())},
                               torch::TensorOptions().dtype(torch::kUInt8).device(t.device()))
                  .copy_(staging);
            } catch (const std::exception& e) {
              error = std::string("nccl link recv: copying out of the GPU: ") + e.what();
            }
          outer->complete(error);
        });
    return outer;
  }

  void abort(const std::string& why) override { comm_->abort(why); }

 private:
  torch::Device gpu() const { return {torch::kCUDA, static_cast<c10::DeviceIndex>(comm_->device())}; }
  bool here(const torch::Tensor& t) const { return t.is_cuda() && t.device().index() == comm_->device(); }

  const bool sender_;
  std::shared_ptr<nccl_communicator> comm_;
};

}  // namespace

bool nccl_built() { return true; }

std::vector<char> nccl_unique_id() {
  ncclUniqueId id;
  const auto r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) throw transport_error(std::string("ncclGetUniqueId: ") + ncclGetErrorString(r));
  const char* p = reinterpret_cast<const char*>(&id);
  return std::vector<char>(p, p + sizeof id);
}

std::shared_ptr<communicator> make_nccl_communicator(const std::vector<char>& unique_id, int rank, int size,
                                                     int device, nccl_options opts) {
  return std::make_shared<nccl_communicator>(unique_id, rank, size, device, opts);
}

std::shared_ptr<ordered_link> make_nccl_link(const std::vector<char>& unique_id, bool sender, int device,
                                             nccl_options opts) {
  return std::make_shared<nccl_link>(unique_id, sender, device, opts);
}

#endif

}  // namespace troupe::transport
