#pragma once
// Point-to-point over links that deliver in order (NCCL's send/recv), for callers that
// match by tag in any order (the stages). A communicator that wraps another (`inner`,
// which keeps the collectives, the small control messages and the peers without a link).
//
// NCCL matches a send with the receive its peer posted at the same position: the sends
// and receives of two ranks must be posted in one order on both sides, while the stages
// send and receive whenever their messages come (and receive by tag). So for a peer with
// an outgoing link (one direction: this rank only sends on it, the peer only receives):
//   sender    numbers its sends to that peer (seq 0, 1, ...); posts the tensor on the link
//             in that order, and sends a control message {seq, bytes} with the caller's
//             tag over `inner`
//   receiver  a receive is matched by (source, tag) over `inner` as any other: its control
//             message says which seq it is; the link receives are posted in seq order once
//             the receives of every earlier seq are known (a receive whose earlier ones
//             are not yet posted waits for them; the sender's link waits with it)
// Two links per pair of ranks that talk both ways: one communicator per direction, so a
// rank's sends never wait behind its receives (with one two-way NCCL communicator, two
// ranks that both send first would each wait for the other).
//
// Both ends decide by size alone (as ipc/ does): tensors of at most `inline_max_bytes`
// go over `inner` directly. A receive whose size differs from the sent one fails (the
// bytes are received into a scratch tensor, the link stays in step); so does a receive
// aborted before its turn came (nothing is written into the caller's tensor). A control
// message that fails breaks its link (its seq is lost): every later receive on it fails.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "transport/transport.hpp"

namespace troupe::transport {

/// What a receive on a link must wait for before it writes the caller's tensor (the work
/// the caller queued so far: a CUDA event on its stream); made on the caller's thread,
/// with whatever the link needs to receive into that tensor (a staging tensor).
class link_fence {
 public:
  virtual ~link_fence() = default;
};

/// One direction between two ranks: the tensors arrive in the order they were sent.
class ordered_link {
 public:
  virtual ~ordered_link() = default;
  virtual std::string backend() const = 0;
  /// Sends `t` after the work the caller queued so far (called on the caller's thread;
  /// the link keeps the order of the calls). Any device: the link stages what it must.
  virtual work_ptr send(torch::Tensor t) = 0;
  /// Made on the caller's thread for a later recv() into `t`.
  virtual std::shared_ptr<link_fence> fence(const torch::Tensor& t) = 0;
  /// Receives the next tensor sent into `t` (same byte count), after `fence` (from
  /// fence(t)). Called from any thread, in the order of the sends.
  virtual work_ptr recv(torch::Tensor t, std::shared_ptr<link_fence> fence) = 0;
  /// Fails every pending and later operation.
  virtual void abort(const std::string& why) = 0;
};

struct ordered_options {
  /// Tensors of at most this many bytes go over `inner` (as in ipc_options).
  std::int64_t inline_max_bytes = 16 << 10;
};

/// `inner` with send/recv to the ranks that have links through them: `to[r]` carries
/// this rank's tensors to rank r, `from[r]` rank r's to this one (null: over `inner`;
/// both indexed by rank, inner->size() long or empty).
std::shared_ptr<communicator> ordered_p2p(std::shared_ptr<communicator> inner,
                                          std::vector<std::shared_ptr<ordered_link>> to,
                                          std::vector<std::shared_ptr<ordered_link>> from, ordered_options opts = {});

/// A link over `c`'s point-to-point to `peer` with the one tag `tag` (messages of one
/// source and tag are matched in order by the UCX and in-process backends). Runs the
/// ordering of ordered_p2p without NCCL: tests, and jobs on the CPU (TROUPE_LINKS=ucx).
/// Its abort() aborts `c`.
std::shared_ptr<ordered_link> tag_link(std::shared_ptr<communicator> c, int peer, std::uint32_t tag);

}  // namespace troupe::transport
