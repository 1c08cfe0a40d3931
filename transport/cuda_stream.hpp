#pragma once
// For the backends that call the CUDA runtime (nccl/, ipc/; compiled where CMake found
// it): the caller's current stream, and telling LibTorch's caching allocator that a
// tensor is in use on another stream. Against a LibTorch without CUDA (Debian's) there
// are no CUDA tensors: the legacy default stream, and nothing to tell.
#include <cuda_runtime_api.h>

#include <torch/types.h>

#ifdef TROUPE_TORCH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace troupe::transport::cuda {

/// The calling thread's current stream on `device` (LibTorch's), which the caller's
/// kernels were queued on.
inline cudaStream_t caller_stream(int device) {
#ifdef TROUPE_TORCH_CUDA
  return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
#else
  (void)device;
  return nullptr;
#endif
}

/// The caching allocator must not hand `t`'s memory out again before the work queued
/// on `stream` is done with it.
inline void used_on(const torch::Tensor& t, cudaStream_t stream, int device) {
#ifdef TROUPE_TORCH_CUDA
  if (t.is_cuda())
    c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(),
                                                  c10::cuda::getStreamFromExternal(stream, device));
#else
  (void)t, (void)stream, (void)device;
#endif
}

}  // namespace troupe::transport::cuda
