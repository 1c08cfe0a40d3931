#pragma once
// supervisor_actor: spawns and monitors the actors of its node (the replicas of its
// node_plan; in one process: all of them), reports their handles to the coordinator, takes
// the whole job's handles (wiring_msg), and after every committed step resets each actor
// and checks what it still held. An actor that dies is reported to the coordinator.
//
//   init (spawn) --run: node_actors--> --wiring_msg--> ready --check/reset_step--> resetting
//        --all reports--> ready;  down_msg of a child --> runtime_failure to the coordinator
#include <memory>

#include <caf/actor.hpp>
#include <caf/event_based_actor.hpp>

#include "actors/runtime.hpp"
#include "transport/transport.hpp"

namespace troupe {

/// What one node hosts: whole replicas [replica_begin, replica_end) (all p stages, their
/// optimizer shards and data loaders) and the shards' communicators.
struct node_plan {
  int replica_begin = 0, replica_end = 0;
  /// [stage][replica - replica_begin]: rank `replica` of the stage's d shards.
  std::vector<std::vector<std::shared_ptr<transport::communicator>>> comms;
};

/// Every replica in this process, shards on in-process communicators.
node_plan local_node_plan(const runtime_context& ctx);

caf::behavior supervisor_actor(caf::event_based_actor* self, std::shared_ptr<const runtime_context> ctx,
                               std::shared_ptr<job_wiring> wiring, node_plan plan);

}  // namespace troupe
