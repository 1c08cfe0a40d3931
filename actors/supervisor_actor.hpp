#pragma once
// supervisor_actor: spawns and monitors the actors of its node (in one process: all of
// them), wires their handles, and after every committed step resets each actor and checks
// what it still held. An actor that dies is reported to the coordinator.
//
//   init (spawn, wire) --run--> ready --check/reset_step--> resetting --all reports--> ready
//                                  \--down_msg--> runtime_failure to the coordinator
#include <memory>

#include <caf/actor.hpp>
#include <caf/event_based_actor.hpp>

#include "actors/runtime.hpp"

namespace troupe {

caf::behavior supervisor_actor(caf::event_based_actor* self, std::shared_ptr<const runtime_context> ctx,
                               std::shared_ptr<job_wiring> wiring);

}  // namespace troupe
