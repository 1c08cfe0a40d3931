#pragma once
// ipc/: point-to-point tensors between processes of one machine through memory both map
// (CUDA IPC for GPU memory; POSIX shared memory for host memory), instead of through the
// network backend. A communicator that wraps another (`inner`, which keeps the
// collectives, the small control messages, and the peers on other machines).
//
// A send to a peer on this machine:
//   sender    copies the tensor into a buffer it exported to that peer (its own, reused
//             once the peer acknowledged the last message in it; made on first use), after
//             the work the caller queued on its stream; marks the buffer ready (CUDA: an
//             inter-process event recorded after the copy), and sends a control message
//             (buffer id, its handle, byte count) with the caller's tag over `inner`
//   receiver  matched by (source, tag) as any receive; maps the buffer on first sight
//             (cached by buffer id), waits for the ready mark, copies into the caller's
//             tensor, and once that copy is done completes its work and acknowledges
//   sender    the acknowledgement frees the buffer and completes the send
// So one transfer is two device-to-device copies and two small messages, and the bytes
// never leave the GPU. Tensors of at most `inline_max_bytes` go over `inner` directly
// (both ends decide by size alone, so a send and its receive must have the same size).
//
// Tags of the caller are below 2^31 (acknowledgements use the upper half). An aborted
// receive writes nothing into the caller's tensor after abort() returns.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "transport/transport.hpp"

namespace troupe::transport {

/// What must finish before a buffer copy may read or write a caller's tensor: the work
/// the caller queued so far (CUDA: an event on its current stream). Made on the caller's
/// thread.
class ipc_fence {
 public:
  virtual ~ipc_fence() = default;
};

/// A buffer this process exported, for one peer.
class ipc_export {
 public:
  virtual ~ipc_export() = default;
  virtual std::size_t capacity() const = 0;
  /// Bytes that let another process of this machine map the buffer (`ipc_memory::open`).
  virtual const std::string& handle() const = 0;
  /// Copies `src`'s bytes into the buffer after `fence`; a reader's `copy_out` that
  /// starts after this call sees them.
  virtual void copy_in(const torch::Tensor& src, const ipc_fence* fence) = 0;
};

/// A peer's buffer mapped into this process.
class ipc_import {
 public:
  virtual ~ipc_import() = default;
  /// Starts copying the buffer's first dst.nbytes() bytes into `dst` (after `fence` and
  /// after the exporter's last copy_in).
  virtual void start_copy_out(torch::Tensor dst, const ipc_fence* fence) = 0;
  /// True once the copy has finished; throws transport_error if it failed.
  virtual bool copy_done() = 0;
  /// Blocks until the copy has finished (or failed).
  virtual void wait_copy() = 0;
};

/// The memory the buffers live in.
class ipc_memory {
 public:
  virtual ~ipc_memory() = default;
  virtual std::string name() const = 0;
  virtual std::shared_ptr<ipc_fence> fence(const torch::Tensor& t) = 0;
  virtual std::unique_ptr<ipc_export> allocate(std::size_t bytes) = 0;
  /// Maps a buffer exported by another process (throws transport_error if it cannot).
  virtual std::unique_ptr<ipc_import> open(const std::string& handle) = 0;
};

/// POSIX shared memory (shm_open; the receiver unlinks the name once it mapped it, so
/// nothing is left behind in /dev/shm after that). Tensors of any device (copied with
/// LibTorch); tests of the protocol on machines without a GPU.
std::shared_ptr<ipc_memory> host_ipc_memory();

/// True when this build has CUDA IPC (the CUDA runtime was found at build time).
bool cuda_ipc_built();
/// GPU memory of device `device` (cudaMalloc'd buffers, cudaIpcGetMemHandle, inter-process
/// events; copies on a stream of its own). Throws transport_error where CUDA IPC is not
/// built or the device cannot be used.
std::shared_ptr<ipc_memory> cuda_ipc_memory(int device);

struct ipc_options {
  /// Tensors of at most this many bytes go over `inner` (one message beats a copy, a
  /// control message and an acknowledgement).
  std::int64_t inline_max_bytes = 16 << 10;
};

/// `inner` with send/recv to the ranks `same_machine` marks (indexed by rank) through
/// buffers of `memory`. Everything else goes to `inner` unchanged.
std::shared_ptr<communicator> ipc_p2p(std::shared_ptr<communicator> inner, std::shared_ptr<ipc_memory> memory,
                                      std::vector<bool> same_machine, ipc_options opts = {});

/// A key naming this machine and its IPC namespace: processes with equal keys can map
/// each other's shared memory and CUDA IPC handles (boot id and IPC namespace).
std::string machine_key();
/// machine_key() plus the PCI address of GPU `device` (cudaDeviceGetPCIBusId): equal for
/// two processes on the same physical GPU, whatever CUDA_VISIBLE_DEVICES numbers it.
/// Throws transport_error where the CUDA runtime is not built in or cannot name the GPU.
std::string gpu_key(int device);

}  // namespace troupe::transport
