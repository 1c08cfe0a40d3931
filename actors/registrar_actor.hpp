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
#include <string>

#include <caf/actor_system.hpp>

#include "messages/interfaces.hpp"

namespace troupe {

/// The registrar of a job of `nodes` node processes; `config_toml` is the job's
/// configuration, `epoch_ns` node 0's clock origin, `data` its data fingerprint.
registrar_actor spawn_registrar(caf::actor_system& sys, std::string token, int nodes, std::string config_toml,
                                std::int64_t epoch_ns, std::string data);

}  // namespace troupe
