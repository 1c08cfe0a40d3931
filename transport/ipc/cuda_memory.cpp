// CUDA IPC memory of transport/ipc (ipc.hpp): buffers from cudaMalloc exported with
// cudaIpcGetMemHandle, readiness as inter-process events, copies on a stream of the
// memory's own. Built where CMake found the CUDA runtime (TROUPE_HAVE_CUDART).
#include "transport/ipc/ipc.hpp"

#ifdef TROUPE_HAVE_CUDART
#include <cstring>

#include "transport/cuda_stream.hpp"
#endif

namespace troupe::transport {

#ifndef TROUPE_HAVE_CUDART

bool cuda_ipc_built() { return false; }
std::shared_ptr<ipc_memory> cuda_ipc_memory(int) {
  throw transport_error("this build has no CUDA IPC (no CUDA runtime was found at build time)");
}
std::string gpu_key(int) { throw transport_error("this build has no CUDA runtime: no GPU to name"); }

#else

namespace {

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw transport_error(std::string("cuda ipc: ") + what + ": " + cudaGetErrorString(e));
}

/// An event on the caller's current stream: what a copy must wait for.
class cuda_fence final : public ipc_fence {
 public:
  explicit cuda_fence(int device) {
    check_cuda(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate");
    check_cuda(cudaEventRecord(event, cuda::caller_stream(device)), "cudaEventRecord");
  }
  ~cuda_fence() override { cudaEventDestroy(event); }
  cudaEvent_t event = nullptr;
};

void wait_fence(cudaStream_t stream, const ipc_fence* f) {
  if (auto* cf = dynamic_cast<const cuda_fence*>(f)) check_cuda(cudaStreamWaitEvent(stream, cf->event, 0), "cudaStreamWaitEvent");
}

/// A handle: the memory handle, then the event handle.
constexpr std::size_t kHandleBytes = sizeof(cudaIpcMemHandle_t) + sizeof(cudaIpcEventHandle_t);

class cuda_export final : public ipc_export {
 public:
  cuda_export(int device, cudaStream_t stream, std::size_t bytes) : device_(device), stream_(stream), capacity_(bytes) {
    check_cuda(cudaSetDevice(device), "cudaSetDevice");
    check_cuda(cudaMalloc(&ptr_, bytes), "cudaMalloc");
    cudaIpcMemHandle_t mem{};
    cudaIpcEventHandle_t ev{};
    auto e = cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming | cudaEventInterprocess);
    if (e == cudaSuccess) e = cudaIpcGetMemHandle(&mem, ptr_);
    if (e == cudaSuccess) e = cudaIpcGetEventHandle(&ev, ready_);
    if (e != cudaSuccess) {
      if (ready_) cudaEventDestroy(ready_);
      cudaFree(ptr_);
      check_cuda(e, "exporting a buffer");
    }
    handle_.resize(kHandleBytes);
    std::memcpy(&handle_[0], &mem, sizeof mem);
    std::memcpy(&handle_[sizeof mem], &ev, sizeof ev);
  }
  ~cuda_export() override {
    cudaEventDestroy(ready_);
    cudaFree(ptr_);
  }
  std::size_t capacity() const override { return capacity_; }
  const std::string& handle() const override { return handle_; }
  void copy_in(const torch::Tensor& src, const ipc_fence* fence) override {
    check_cuda(cudaSetDevice(device_), "cudaSetDevice");
    wait_fence(stream_, fence);
    check_cuda(cudaMemcpyAsync(ptr_, src.data_ptr(), src.nbytes(), cudaMemcpyDefault, stream_), "cudaMemcpyAsync");
    check_cuda(cudaEventRecord(ready_, stream_), "cudaEventRecord");
    cuda::used_on(src, stream_, device_);
  }

 private:
  int device_;
  cudaStream_t stream_;
  std::size_t capacity_;
  void* ptr_ = nullptr;
  cudaEvent_t ready_ = nullptr;
  std::string handle_;
};

class cuda_import final : public ipc_import {
 public:
  cuda_import(int device, cudaStream_t stream, const std::string& handle) : device_(device), stream_(stream) {
    if (handle.size() != kHandleBytes)
      throw transport_error("cuda ipc: a handle has " + std::to_string(kHandleBytes) + " bytes, not " +
                            std::to_string(handle.size()));
    cudaIpcMemHandle_t mem;
    cudaIpcEventHandle_t ev;
    std::memcpy(&mem, handle.data(), sizeof mem);
    std::memcpy(&ev, handle.data() + sizeof mem, sizeof ev);
    check_cuda(cudaSetDevice(device), "cudaSetDevice");
    check_cuda(cudaIpcOpenMemHandle(&ptr_, mem, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
    auto e = cudaIpcOpenEventHandle(&ready_, ev);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&done_, cudaEventDisableTiming);
    if (e != cudaSuccess) {
      cudaIpcCloseMemHandle(ptr_);
      check_cuda(e, "opening the peer's event");
    }
  }
  ~cuda_import() override {
    cudaEventSynchronize(done_);
    cudaEventDestroy(done_);
    cudaEventDestroy(ready_);
    cudaIpcCloseMemHandle(ptr_);
  }
  void start_copy_out(torch::Tensor dst, const ipc_fence* fence) override {
    check_cuda(cudaSetDevice(device_), "cudaSetDevice");
    check_cuda(cudaStreamWaitEvent(stream_, ready_, 0), "cudaStreamWaitEvent (the sender's copy)");
    wait_fence(stream_, fence);
    check_cuda(cudaMemcpyAsync(dst.data_ptr(), ptr_, dst.nbytes(), cudaMemcpyDefault, stream_), "cudaMemcpyAsync");
    check_cuda(cudaEventRecord(done_, stream_), "cudaEventRecord");
    cuda::used_on(dst, stream_, device_);
  }
  bool copy_done() override {
    const auto q = cudaEventQuery(done_);
    if (q == cudaErrorNotReady) return false;
    check_cuda(q, "the copy out of the peer's buffer");
    return true;
  }
  void wait_copy() override { check_cuda(cudaEventSynchronize(done_), "the copy out of the peer's buffer"); }

 private:
  int device_;
  cudaStream_t stream_;
  void* ptr_ = nullptr;
  cudaEvent_t ready_ = nullptr, done_ = nullptr;
};

class cuda_memory final : public ipc_memory {
 public:
  explicit cuda_memory(int device) : device_(device) {
    int n = 0;
    check_cuda(cudaGetDeviceCount(&n), "cudaGetDeviceCount");
    if (device < 0 || device >= n)
      throw transport_error("cuda ipc: no GPU " + std::to_string(device) + " (" + std::to_string(n) + " visible)");
    check_cuda(cudaSetDevice(device), "cudaSetDevice");
    // Sends and receives copy on streams of their own: a receive waiting for its sender
    // does not hold up this process's sends.
    check_cuda(cudaStreamCreateWithFlags(&send_stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    check_cuda(cudaStreamCreateWithFlags(&recv_stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  }
  // The streams are never destroyed: tensors copied on them are marked used there
  // (cuda::used_on), and LibTorch's caching allocator records an event on each such stream
  // when the tensor is freed, which may be after this memory is gone (a node makes new
  // communicators when a peer rejoins): a destroyed stream there ended node processes
  // ("CUDA error: context is destroyed", nodes-4-rejoin on an H200). A few streams per
  // rejoin stay behind.
  ~cuda_memory() override = default;
  std::string name() const override { return "CUDA IPC buffers on GPU " + std::to_string(device_); }
  std::shared_ptr<ipc_fence> fence(const torch::Tensor& t) override {
    if (!t.is_cuda()) return nullptr;  // host memory: the caller's writes are done
    check_cuda(cudaSetDevice(device_), "cudaSetDevice");
    return std::make_shared<cuda_fence>(device_);
  }
  std::unique_ptr<ipc_export> allocate(std::size_t bytes) override {
    return std::make_unique<cuda_export>(device_, send_stream_, bytes);
  }
  std::unique_ptr<ipc_import> open(const std::string& handle) override {
    return std::make_unique<cuda_import>(device_, recv_stream_, handle);
  }

 private:
  int device_;
  cudaStream_t send_stream_ = nullptr, recv_stream_ = nullptr;
};

}  // namespace

bool cuda_ipc_built() { return true; }
std::shared_ptr<ipc_memory> cuda_ipc_memory(int device) { return std::make_shared<cuda_memory>(device); }

std::string gpu_key(int device) {
  char bus[64] = {};
  check_cuda(cudaDeviceGetPCIBusId(bus, sizeof bus, device), "cudaDeviceGetPCIBusId");
  return machine_key() + "/gpu " + bus;
}

#endif

}  // namespace troupe::transport
