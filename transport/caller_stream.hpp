#pragma once
// The stream a caller's kernels on a GPU tensor are queued on, for work done later on
// another thread (a transfer's completion): LibTorch's caching allocator hands a tensor's
// memory out again in the order of the stream it was allocated on, so bytes written into
// a freshly allocated tensor from any other stream can land while that stream's earlier
// kernels still read the memory's previous tensor. Device-generic c10 calls: compiles
// against a LibTorch without CUDA (Debian's), where there are no GPU tensors.
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/types.h>

namespace troupe::transport {

/// The calling thread's current stream on `t`'s device; none for a CPU tensor.
inline c10::optional<c10::Stream> caller_stream_of(const torch::Tensor& t) {
  if (!t.is_cuda()) return c10::nullopt;
  return c10::impl::getDeviceGuardImpl(t.device().type())->getStream(t.device());
}

}  // namespace troupe::transport
