#pragma once
// Hybrid sharding (HSDP): the d ranks of a communicator as d / g shard groups of g
// consecutive ranks, each holding the whole state sharded g ways, replicated across the
// groups (torch's HSDP mesh: replicate x shard, shard fastest).
//
//   parent ranks (d = 4, g = 2):   0  1 | 2  3
//   shard groups:                  [0 1] [2 3]      (this communicator: rank j mod g of g)
//   replica groups:                {0 2} {1 3}      (the same shard index in every group)
//
// The result is a communicator of g ranks whose collectives keep the meaning the shards
// of a data-parallel group expect of theirs:
//   reduce_scatter  this rank's piece of the sum over all d ranks: a ring reduce-scatter
//                   within the shard group, then a ring all-reduce of that piece across
//                   the replica group (the ranks of the same shard index). Every replica
//                   of a piece receives the same bits (the ring all-reduce adds each part
//                   once, at one rank); the order of the sum differs from a d-way ring's.
//   all_gather      within the shard group (the replicas hold the same pieces).
//   all_reduce      the sum over all d ranks (reduce-scatter as above, then all-gather).
//   broadcast, point-to-point, all_to_all: within the shard group (ranks 0 .. g-1).
// The collectives run on a thread of the communicator, one at a time, in call order, as
// ring steps over the parent's point-to-point (tags of their own, below 2^31): every
// member must call them in one order, as for any communicator. Needs a parent whose
// point-to-point matches by tag (local/, ucx/; not NCCL's ordered send/recv). The ring's
// three piece-sized buffers are freed whenever no call waits (above 4 MB).

#include <chrono>
#include <memory>

#include "transport/transport.hpp"

namespace troupe::transport {

/// Rank parent->rank() mod `shard` of its shard group of `shard` ranks (parent->size() a
/// multiple of `shard`); `parent` itself when `shard` is its size. A transfer of a
/// collective that does not complete within `timeout` fails it (a peer died or froze).
std::shared_ptr<communicator> hybrid_shard_group(std::shared_ptr<communicator> parent, int shard,
                                                 std::chrono::milliseconds timeout = std::chrono::seconds(60));

}  // namespace troupe::transport
