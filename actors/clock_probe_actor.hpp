#pragma once
// The clock probe of a node on another machine than node 0's: rounds of 8 round trips to
// the registrar, each refitting the node's job clock (offset and rate), so that the
// node's trace events stay on node 0's timeline while the two clocks drift apart. The
// first round comes 0.1 s after the join probe and the waits double up to `interval`.
#include <chrono>
#include <memory>

#include <caf/actor_system.hpp>

#include "actors/trace.hpp"
#include "messages/interfaces.hpp"

namespace troupe {

clock_probe_actor spawn_clock_probe(caf::actor_system& sys, registrar_actor registrar, std::shared_ptr<job_clock> clock,
                                    std::chrono::milliseconds interval);

}  // namespace troupe
