#pragma once
// GPU tensors over a backend that moves host memory only (the UCX backend: its ring
// collectives sum with LibTorch CPU ops, and Debian's UCX has no CUDA module): a
// communicator that wraps another and stages every tensor not in host memory through a
// host copy.
//
//   call:        a host copy of each input (blocking device-to-host copy on the calling
//                thread's current stream, so it follows the kernels queued there that
//                wrote the tensor), a host buffer for each output (page-locked memory
//                for CUDA tensors)
//   inner work:  runs on the host tensors
//   completion:  each output copied back into the caller's tensor (blocking
//                host-to-device copy on the completing thread), then the work completes
//
// The caller's tensors are written only before its work completes and never after its
// abort() returns; a failed inner work writes nothing.
//
// Host tensors pass straight to the inner communicator (no copy) unless `always` is set,
// which stages them too (tests run the staging path on machines without a GPU).
#include <memory>

#include "transport/transport.hpp"

namespace troupe::transport {

/// `inner` taking tensors on any device (contiguous, the dtypes `inner` takes).
std::shared_ptr<communicator> stage_through_host(std::shared_ptr<communicator> inner, bool always = false);

/// The same the other way round, for a backend that moves GPU memory only (NCCL): every
/// tensor not on `device` (cuda:N) goes through a copy there (a host-to-device copy before
/// the operation, the result copied back when it completes). Tensors on `device` pass
/// straight through.
std::shared_ptr<communicator> stage_through_device(std::shared_ptr<communicator> inner, torch::Device device);

}  // namespace troupe::transport
