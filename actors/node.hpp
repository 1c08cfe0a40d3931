#pragma once
// One node of a multi-process job: an actor system with CAF's middleman, a supervisor for
// the node's replicas, and on node 0 the registrar (joins) and the coordinator.
//
//   node 0: publish registrar on the job's port; join itself like every node; when all
//           nodes are ready, spawn the coordinator with every node's supervisor and run.
//   node i: connect to the registrar (retrying until the join timeout); node_hello with
//           the job token (from the environment) and protocol version -> the job's config;
//           UCX addresses of its shards -> the table of all; connect the shards'
//           communicators; spawn the supervisor; node_ready; then serve until the
//           coordinator stops the supervisor (exit 0) or node 0 is gone (exit 1).
//   node i restarted (rejoin): once node 0 saw the old process go, node_hello{rejoin} ->
//           the config; a supervisor without actors; node_ready -> the coordinator, which
//           has every node rebuild its actors (this one from its buddy's shard copies).
//
// Layout: node i hosts an equal run of the replica-major (replica, stage) list (whole
// replicas when N divides d): each stage with its optimizer shard, and the loader of each
// replica whose first stage it hosts. Activations and gradients between stages on
// different nodes travel over the nodes' world communicator (UCX); the shards'
// collectives over their stage's communicator (UCX); control messages over CAF.
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "actors/node_transport.hpp"
#include "actors/runtime.hpp"

namespace troupe {

struct node_options {
  int node = 0;
  int nodes = 1;
  std::string host = "127.0.0.1";  ///< node 0's address (where the registrar listens)
  std::uint16_t port = 0;          ///< the registrar's port
  std::string token;               ///< the job's join token (TROUPE_JOB_TOKEN)
  std::int32_t version = 0;        ///< protocol version presented (0: this build's); tests
  /// Tests (TROUPE_TEST_CLOCK_SKEW_MS): this node acts as on another machine than node 0's
  /// whose steady clock is this far ahead (its trace events must still land on node 0's
  /// timeline).
  std::int64_t clock_skew_ns = 0;
  /// Tests (TROUPE_TEST_CLOCK_DRIFT_PPM): and whose clock runs this fast against node 0's.
  double clock_drift_ppm = 0;
  /// A node on another machine than node 0's probes node 0's clock again, 0.1 s after
  /// joining and then at doubling waits up to this one (TROUPE_CLOCK_PROBE_SECONDS),
  /// following a drift between the two clocks; 0: only at join.
  std::chrono::milliseconds clock_probe_interval{10000};
  job_config cfg;                  ///< node 0: the job (other nodes receive it)
  actor_run_options run;           ///< node 0: progress, trace
  int nodes_per_host = 1;          ///< node processes sharing this machine's cores (threads = 0)
  /// This node's number among the node processes of its machine (from 0): with
  /// `device = "cuda"` it computes on GPU local_node % (the machine's GPUs).
  int local_node = 0;
  /// TLS between the nodes' actor systems (CAF's openssl module): this node's certificate
  /// and key (PEM) and the CA file that peers' certificates must chain to. Empty: plain
  /// TCP. Every node of a job must agree (a TLS node and a plain one cannot talk).
  std::string tls_certificate, tls_key, tls_cafile;
  /// A process the launcher started in place of a lost node (TROUPE_REJOIN=1): it joins
  /// the running job, which rebuilds its actors from its buddy's copies.
  bool rejoin = false;
  node_transport_settings transport;  ///< how tensors travel between nodes (the launcher's environment)
  std::chrono::milliseconds join_timeout{60000};
  std::chrono::milliseconds heartbeat{500};           ///< CAF middleman heartbeats
  std::chrono::milliseconds connection_timeout{5000};  ///< a silent peer is gone after this
};

/// Why a group of node processes' ranks cannot run its collectives over NCCL, given each
/// member's GPU key by rank (transport::gpu_key(); empty for a member that does not ask
/// for NCCL); empty when it can: every member asks and each has a GPU of its own (NCCL
/// puts one rank of a communicator per GPU). A group of one rank has nothing to gain.
std::string nccl_refusal(const std::vector<std::string>& member_gpus);

/// The ordered pairs (from, to) of distinct nodes whose stages pass activations or
/// gradients to each other with `nodes` node processes (the layout of node_slots):
/// neighbouring stages of a replica, and its first and last stage (tied embeddings, the
/// chunks of an interleaved schedule); sorted. With TROUPE_NCCL=1 each gets a NCCL link
/// (transport/ordered_p2p.hpp) where both nodes have a GPU of their own.
/// With tensor parallelism (`t` > 1: the layout of node_slots with t) rank tp of a stage
/// sends to rank tp of the next.
std::vector<std::pair<int, int>> link_pairs(int p, int d, int nodes, int t = 1);
/// The nodes node `node`'s world communicator connects to (sorted, without itself): the
/// other ends of its link_pairs() (the only nodes its stages pass tensors to or take them
/// from) and the nodes its shards' buddy copies go to or come from (node n > 0 sends
/// its shards' to node n + 1 mod `nodes`). The world connects only these: at 2,048 nodes
/// of one stage each, 2 or 3 of them instead of 2,047.
std::vector<std::int32_t> world_peers(int p, int d, int nodes, int t, int node);

struct node_addresses;  // messages/node_messages.hpp

/// The table's `stages` entry of a link from node `from` (its `replicas` entry names the
/// receiving node, its `nccl_ids` entry the id): -2 - from (-1 is the world).
constexpr std::int32_t link_entry(int from) { return -2 - from; }

/// The address table's entries (node_addresses::stages) of expert-parallel groups: the
/// stage actors of replicas EP g .. EP g + EP - 1 at stage k are group g of `groups`, entry
/// expert_group_entry(k, g, groups, backward) for the forwards' group and the backwards';
/// below every link entry (-2 - node). Over NCCL where asked for and every member has a
/// GPU of its own (their rank 0's entry gets an id, as a shard group's), else over UCX.
constexpr std::int32_t expert_group_base = -(1 << 24);
constexpr std::int32_t expert_group_entry(int stage, int group, int groups, bool backward) {
  return expert_group_base - 2 * (stage * groups + group) - (backward ? 1 : 0);
}
/// The entries of the shards' expert-data-parallel groups (expert parallelism): the shards
/// of stage k of the pipelines holding share c of the experts (q mod EP = c) are entry
/// expert_shard_entry(k, c, EP), rank q / EP; below every expert group's entry. Over NCCL
/// where asked for and every member has a GPU of its own (as a shard group), else UCX.
constexpr std::int32_t expert_shard_base = -(1 << 26);
constexpr std::int32_t expert_shard_entry(int stage, int share, int ep) { return expert_shard_base - (stage * ep + share); }
/// The entries of tensor-parallel groups that span node processes (node_slots with more
/// nodes than p x d): the stage actors of pipelines t dp .. t dp + t - 1 at stage k are
/// entry tensor_group_entry(k, dp, d), rank tp; below every expert group's entry. They run
/// over NCCL where asked for and every member has a GPU of its own (their rank 0's entry
/// gets an id, as a shard group's), else over UCX.
constexpr std::int32_t tensor_group_base = -(1 << 28);
constexpr std::int32_t tensor_group_entry(int stage, int replica, int d) { return tensor_group_base - (stage * d + replica); }
/// The entries of context-parallel groups that span node processes (node_slots with more
/// nodes than p x data-parallel replicas): the stage actors at stage k of the pipelines
/// (data c + cp) t + tp, cp = 0 .. c-1, are entry context_group_entry(k, data t + tp,
/// data-parallel replicas x t), rank cp; below every tensor-parallel group's entry. Over
/// UCX (context parallelism runs on the CPU).
constexpr std::int32_t context_group_base = -(1 << 29);
constexpr std::int32_t context_group_entry(int stage, int group, int groups) {
  return context_group_base - (stage * groups + group);
}
constexpr bool is_expert_shard_entry(std::int32_t entry) { return entry <= expert_shard_base && entry > tensor_group_base; }
constexpr bool is_expert_group_entry(std::int32_t entry) { return entry <= expert_group_base && entry > expert_shard_base; }
constexpr bool is_link_entry(std::int32_t entry) { return entry <= link_entry(0) && entry > expert_group_base; }

/// The registrar's part of NCCL, once every node has sent its entries of an address
/// round: a NCCL unique id (`make_id()`; empty where making one failed) for each shard
/// group, expert shard group and tensor-parallel group spread over nodes whose members' GPU keys
/// nccl_refusal accepts (into its rank 0's entry), and for
/// each link entry (stage -2 - from, replica = to; not an expert group's) whose two nodes' world entries'
/// keys it accepts. No other ids are made: NCCL keeps a thread waiting for the ranks of
/// every id it made, so an id nobody uses would leave one behind per round. Returns the
/// number of ids given.
int assign_nccl_ids(node_addresses& table, const std::function<std::string()>& make_id);

/// Runs this node until the job ends. Node 0 returns the job's result; the others return
/// exit_code 0 when the coordinator stopped them cleanly, else 1 (with `error`), 2 for a
/// layout that does not fit the nodes, 3 when their join was refused.
actor_run_result run_node(const node_options& opts);


}  // namespace troupe
