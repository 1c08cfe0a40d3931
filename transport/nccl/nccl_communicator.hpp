#pragma once
// NCCL backend of transport/: ranks on GPUs (one GPU per rank), tensors in GPU memory.
// Built where CMake finds the CUDA runtime and NCCL (TROUPE_HAVE_NCCL); the header needs
// neither (no CUDA types here).
//
// - Created from a unique id (`nccl_unique_id()` on one rank, its bytes sent to the others
//   through the actors' control plane), non-blocking (so creation and every operation
//   can be timed out and aborted).
// - Every operation runs on the communicator's own CUDA stream, after the kernels queued
//   so far on the caller's current stream (an event), and the caller's stream waits for it
//   in turn; the `work` completes when the GPU has finished it (a progress thread polls).
// - A NCCL error, an operation running past `timeout`, or abort() aborts the
//   communicator (ncclCommAbort): every pending and later operation fails with a
//   transport_error, which the actors turn into a step abort.
// - Differences from the other backends: sums follow NCCL's order (not the ring order of
//   transport.hpp: equal within float tolerance, not bit for bit); reduce_scatter and
//   all_gather need numel divisible by size() (the optimizer's buffers are padded so);
//   send/recv match by order per peer (tags are not used).
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "transport/ordered_p2p.hpp"
#include "transport/transport.hpp"

namespace troupe::transport {

/// True when this build has the NCCL backend.
bool nccl_built();
/// A fresh NCCL unique id (128 bytes) to hand to every rank. Throws transport_error
/// where NCCL is not built or fails.
std::vector<char> nccl_unique_id();

struct nccl_options {
  std::chrono::milliseconds timeout{std::chrono::seconds(60)};  ///< creation, and each operation
};

/// Rank `rank` of `size` on GPU `device`, joined through `unique_id`. Throws
/// transport_error if the other ranks do not join within the timeout (the half-made
/// communicator is aborted) or NCCL fails.
std::shared_ptr<communicator> make_nccl_communicator(const std::vector<char>& unique_id, int rank, int size,
                                                     int device, nccl_options opts = {});

/// One direction between two GPUs for ordered_p2p: a NCCL communicator of two ranks made
/// from `unique_id` (the sender is its rank 0, the receiver its rank 1) on GPU `device`.
/// Tensors elsewhere are staged through that GPU. The sender's stream does not wait for a
/// send (the tensor is kept until it is out); a receive starts after its fence's event.
/// Throws transport_error as make_nccl_communicator does.
std::shared_ptr<ordered_link> make_nccl_link(const std::vector<char>& unique_id, bool sender, int device,
                                             nccl_options opts = {});

}  // namespace troupe::transport
