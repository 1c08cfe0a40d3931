#pragma once
// Joining a job and wiring it across nodes (one actor system per node process).
//
//   node --node_hello{version, token}--> registrar (node 0): job_offer (config, epoch,
//        machine), or an error (wrong token or protocol version: refused and logged)
//   node whose data (training_data::fingerprint) is missing or not node 0's (job_offer.data)
//        --node_unfit{reason}--> registrar: the job does not start, with that reason
//   node of another machine than node 0's --clock_atom--> registrar (8 times): node 0's
//        steady clock (ns), for the offset between the two clocks (one trace timeline)
//   node --node_addresses{round 0}--> registrar: UCX worker addresses of the node's
//        optimizer shards (with machine and GPU keys, and a NCCL unique id from the rank 0
//        of a group that asks for NCCL) and its world peers; answered, once all nodes sent
//        theirs, with its part of the table (table_for: its groups' entries, its world
//        peers' and the links it is an end of)
//   supervisor --node_addresses{round n > 0}--> registrar: addresses of the fresh
//        communicators of a step retried in place (n-th in-place recovery of the job);
//        answered with its part of that round's table
//   node --node_ready{supervisor}--> registrar; the coordinator then asks every
//        supervisor for its actors (node_actors) and sends every supervisor the whole
//        job's handles (wiring_msg) before the first step.
//   shard (node i > 0) --shard_copy--> supervisor of node (i + 1) mod N (its buddy):
//        the shard's state before the next step, kept in memory there; acknowledged
//   a lost node i > 0, restarted by the launcher: node_hello{rejoin} once node 0 saw it
//        go --> a supervisor without actors --node_ready--> registrar --> coordinator
//        (rejoin_atom); its recover takes its shards' copies from the buddy (buddy_atom)
#include <cstdint>
#include <string>
#include <vector>

#include <caf/actor.hpp>
#include <caf/meta/type_name.hpp>

#include "messages/tensor_payload.hpp"

namespace troupe {

/// Bumped whenever a message of the job changes: nodes of other versions are refused.
constexpr std::int32_t protocol_version = 11;  // raised with every change of a message or the type-ID block

struct node_hello {
  std::int32_t version = 0;
  std::string token;
  std::int32_t node = 0;
  std::int32_t nodes = 0;
  std::string host;
  bool rejoin = false;  ///< a node process restarted after the job lost it
  std::string machine;  ///< transport::machine_key() of its machine
  std::int32_t pid = 0; ///< its process (node 0 ends it when the job loses it: fencing)
};

/// UCX worker addresses of shards (stage, replica) hosted by one node, or, as the
/// registrar's answer, of every shard of the job.
/// Registrar -> admitted node: the job's configuration, the coordinator's trace epoch
/// (steady clock) and node 0's machine (transport::machine_key()). A node of that machine
/// shares node 0's clock; one of another machine first measures the offset between the
/// clocks: it asks the registrar `clock_atom` a few times, answered with node 0's steady
/// clock in nanoseconds (actors/trace.hpp, clock_offset_ns).
struct job_offer {
  std::string config_toml;
  std::int64_t epoch_ns = 0;
  std::string machine;
  /// Node 0's training_data::fingerprint: every node must read the same data (one that
  /// reads other data sends node_unfit instead of taking part).
  std::string data;
};

/// Node -> registrar, after the offer: this node cannot run the job (its data is missing or
/// is not node 0's). The job does not start (node 0 ends with the reason) and a rejoin
/// fails; answered true.
struct node_unfit {
  std::int32_t node = 0;
  std::string host, reason;
};

struct node_addresses {
  std::int32_t node = 0;
  std::int32_t round = 0;  ///< 0: joining; n > 0: the job's n-th in-place recovery
  std::vector<std::int32_t> stages, replicas;
  std::vector<std::string> addresses;
  std::vector<std::string> machines;  ///< per entry: its node's transport::machine_key()
  /// Per entry, for a NCCL group: the node's transport::gpu_key() when it would run that
  /// group's collectives over NCCL (else empty), and, in the registrar's table, in the
  /// group's rank 0 entry, the NCCL unique id's bytes where the group runs over NCCL (else
  /// empty; assign_nccl_ids). The world entry (stage -1) carries the node's GPU key for
  /// NCCL links; an entry of stage -2 - n (no address) asks for a link from node n to
  /// node `replicas[i]` and, in the table, carries its id.
  std::vector<std::string> gpus, nccl_ids;
  /// The nodes whose world entries (stage -1) this node connects to (world_peers); empty:
  /// every node's. The registrar's answer keeps only those.
  std::vector<std::int32_t> peers;
};

struct node_ready {
  std::int32_t node = 0;
  caf::actor supervisor;
};

/// Supervisor -> coordinator: the actors it spawned: per slot (replica, stage) the stage
/// actor and the stage's optimizer shard of that rank; the loaders of `loader_replicas`.
struct node_actors {
  std::int32_t node = 0;
  std::vector<std::int32_t> slot_replicas, slot_stages;
  std::vector<caf::actor> stages, shards;
  std::vector<std::int32_t> loader_replicas;
  std::vector<caf::actor> loaders;
};

/// Coordinator -> supervisors: every actor of the job (stages [replica][stage] and
/// shards [stage][rank] flattened row-major, loaders by replica) and the node of every
/// stage ([replica][stage] row-major), and every node's supervisor (by node; empty when
/// lost nodes are not restarted: then no node keeps buddy copies).
struct wiring_msg {
  caf::actor coordinator;
  std::vector<caf::actor> stages, shards, loaders;
  std::vector<std::int32_t> nodes;
  std::vector<caf::actor> supervisors;
};

/// An optimizer shard's state before step `step`, per chunk (a buddy copy: kept by the
/// supervisor of the next node, so that the shard survives the loss of its node).
struct shard_copy {
  std::int32_t stage = 0, rank = 0;
  std::int64_t step = 0;
  std::vector<tensor_payload> params, exp_avg, exp_avg_sq;
  std::vector<std::int64_t> steps, stage_numel;
  std::vector<std::int64_t> stage_expert_offset;  ///< per chunk (shard_snapshot)
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, node_hello& x) {
  return f(caf::meta::type_name("node_hello"), x.version, x.token, x.node, x.nodes, x.host, x.rejoin, x.machine,
           x.pid);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, job_offer& x) {
  return f(caf::meta::type_name("job_offer"), x.config_toml, x.epoch_ns, x.machine, x.data);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, node_unfit& x) {
  return f(caf::meta::type_name("node_unfit"), x.node, x.host, x.reason);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, node_addresses& x) {
  return f(caf::meta::type_name("node_addresses"), x.node, x.round, x.stages, x.replicas, x.addresses,
                           x.machines, x.gpus, x.nccl_ids, x.peers);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, node_ready& x) {
  return f(caf::meta::type_name("node_ready"), x.node, x.supervisor);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, node_actors& x) {
  return f(caf::meta::type_name("node_actors"), x.node, x.slot_replicas, x.slot_stages, x.stages, x.shards,
           x.loader_replicas, x.loaders);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, wiring_msg& x) {
  return f(caf::meta::type_name("wiring_msg"), x.coordinator, x.stages, x.shards, x.loaders, x.nodes,
           x.supervisors);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, shard_copy& x) {
  return f(caf::meta::type_name("shard_copy"), x.stage, x.rank, x.step, x.params, x.exp_avg, x.exp_avg_sq, x.steps,
           x.stage_numel, x.stage_expert_offset);
}

}  // namespace troupe
