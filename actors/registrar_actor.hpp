#pragma once
// The registrar, on node 0 of a multi-process job: admits node processes that present
// the job's token and protocol version and hands them the job (its configuration, clock
// epoch and data fingerprint); exchanges the nodes' transport addresses (as they join,
// and again for every in-place recovery); collects their supervisors for the
// coordinator; answers clock probes; and takes a restarted node process back in the
// place of a lost one (rejoin). A node that cannot run the job (node_unfit) ends it at
// once, with the reason.
//
// States: admitting (nodes join, address round 0) -> ready (every node reported its
// supervisor; the coordinator runs) -> serving (address rounds of recoveries, rejoins,
// clock probes) until the job ends.
#include <cstdint>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <caf/actor_system.hpp>
#include <caf/local_actor.hpp>
#include <caf/response_promise.hpp>
#include <caf/result.hpp>

#include "messages/interfaces.hpp"

namespace troupe {

/// The registrar of a job of `nodes` node processes; `config_toml` is the job's
/// configuration, `epoch_ns` node 0's clock origin, `data` its data fingerprint.
registrar_actor spawn_registrar(caf::actor_system& sys, std::string token, int nodes, std::string config_toml,
                                std::int64_t epoch_ns, std::string data);

/// What a node gets of a round's table `all` (every node's entries, with the NCCL ids),
/// given its own entries `mine`: the entries of the groups it is a member of (the ids its
/// own entries name: its shard groups, and the groups of tensor, context and expert
/// parallelism it spans nodes with), the world entries of its peers (mine.peers; all of
/// them when it names none) and its own, and the links it is an end of. A group that runs
/// over NCCL (an id in one of its entries) keeps its entries' GPU keys and id, not their
/// addresses: its members connect by the id. A node connects only these, so the rest
/// would be dead weight: with 2,048 nodes of 8 ranks (tensor parallelism within the node,
/// 16 stages, 128 replicas), a node needs the 1,024 entries of its 8 shard groups and 3 or
/// 4 world entries, not all 18,432.
node_addresses table_for(const node_addresses& all, const node_addresses& mine);
/// Adds node `a`'s entries to a round's table (every per-entry field).
void add_entries(node_addresses& table, const node_addresses& a);

/// One round of an address exchange (node 0's registrar's, the simulated nodes'): every
/// node's entries, and to each node the promise of its part of the table.
class address_round {
 public:
  /// Node `a`'s entries, answered once the round is delivered; an error when the node
  /// sent its entries before in this round.
  caf::result<node_addresses> add(caf::local_actor* self, const node_addresses& a);
  int nodes() const { return int(sent_.size()); }
  node_addresses& table() { return table_; }
  /// Each node its part of the table (table_for).
  void deliver();
  /// Each node `why` instead.
  void fail(const caf::error& why);

 private:
  node_addresses table_;
  std::set<int> sent_;
  std::vector<std::pair<node_addresses, caf::response_promise>> waiters_;  // (the node's entry ids, its promise)
};

}  // namespace troupe
