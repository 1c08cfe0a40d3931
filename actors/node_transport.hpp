#pragma once
// How a node process's tensors travel to the other nodes, and the communicators it makes
// for that (at its join and again for every in-place recovery).
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "actors/runtime.hpp"
#include "actors/supervisor_actor.hpp"

namespace troupe {

/// The node's transport settings as the launcher's environment gives them (launch/
/// parses them once; transport_for checks them): TROUPE_STAGE_THROUGH_HOST ("1"),
/// TROUPE_IPC (host | cuda | 0 | off), TROUPE_NCCL (1 | 0), TROUPE_LINKS (ucx | 0).
struct node_transport_settings {
  std::string stage_through_host, ipc, nccl, links;
};

/// How a node's tensors travel to other nodes: through host copies (`staged`:
/// transport/host_staging.hpp; GPU tensors over the UCX backend) and, between node
/// processes of one machine, point-to-point through shared buffers (`ipc`:
/// transport/ipc/ipc.hpp; CUDA IPC on a GPU).
struct node_transport {
  enum class staging { off, device_tensors, all_tensors } staged = staging::off;
  enum class ipc_memory { off, host, cuda } ipc = ipc_memory::off;
  int device = 0;  ///< the node's GPU (CUDA IPC buffers, NCCL)
  /// Node processes on this machine (the launcher's TROUPE_NODES_PER_HOST): whether the
  /// world's progress threads spin (transport::resolve_spin) counts them all, not only
  /// the peers the world connects to.
  int host_nodes = 1;
  /// The shard groups' collectives, and the tensors between stages on nodes of
  /// link_pairs(), over NCCL where every member has a GPU of its own (TROUPE_NCCL=1).
  bool nccl = false;
  /// Tests of the links without NCCL: the tensors between stages on nodes of link_pairs()
  /// through ordered_p2p over links on one UCX tag (TROUPE_LINKS=ucx).
  bool ucx_links = false;
  /// Hybrid sharding (parallel.shard_group): each slot's shard communicator is its rank
  /// of a shard group of this many ranks over the d-rank one (transport/hybrid.hpp); 0:
  /// the whole group.
  int shard_group = 0;
  /// The same for the experts' regions (runtime_context::eg): each slot's
  /// expert-data-parallel communicator, a shard group of this many ranks; 0: the whole.
  int expert_shard_group = 0;
};

/// How this node's tensors travel, with the reasons logged. On a GPU: tensors staged
/// through host memory, because the UCX backend moves host memory only (even where UCX
/// itself could move CUDA memory), and point-to-point to node processes of this machine
/// through CUDA IPC buffers (where the build has the CUDA runtime). On the CPU: plain UCX
/// (its shared-memory transports already map host memory). For tests of these paths
/// without a GPU: TROUPE_STAGE_THROUGH_HOST=1 stages CPU tensors too, TROUPE_IPC=host
/// moves point-to-point through POSIX shared memory; TROUPE_IPC=0 turns the buffers off.
/// A bad setting throws config_error.
node_transport transport_for(const runtime_context& ctx, const node_transport_settings& settings,
                             const std::string& where);

/// The communicators of node `node` of `nodes` hosting `slots` ((pipeline, stage) pairs)
/// of a p x d (x t) job, made as `transport` says: per slot rank dp of its (stage,
/// tensor-parallel rank)'s d shards, the world of the nodes (rank = node), with expert
/// parallelism `ep` > 1 per slot rank r mod ep of its stage's expert-parallel group (UCX),
/// and with tensor parallelism `t` > 1 per slot rank tp of its (replica, stage)'s
/// tensor-parallel group: in this process where node_slots put the whole group here,
/// else over UCX (entry tensor_group_entry). With context parallelism `c` > 1 (`d` then
/// counts its ranks: data_parallel x c) per slot rank cp of its (replica, stage, tp)'s
/// context-parallel group: in this process where the group is whole here, else over UCX
/// (entry context_group_entry).
std::unique_ptr<comm_renewal> make_node_comms(int node, int nodes, int p, int d, int t, int ep, int c,
                                              std::vector<std::pair<int, int>> slots, node_transport transport);

}  // namespace troupe
