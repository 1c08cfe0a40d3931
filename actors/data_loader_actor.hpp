#pragma once
// data_loader_actor: one per data-parallel replica. Produces the replica's micro-batches
// of each step deterministically (WORKLOADS.md) and sends inputs to the first stage and
// targets to the last: all of a step's at its begin, or (parallel.credit_window) that
// many ahead of what the first stage has consumed (each consumed micro-batch returns a
// credit while there are more to send).
//
// Two named behaviors (become()):
//
//        begin_step (send window)        credit (send one more)
//   idle -------------------------> feeding -----------------> feeding ... all sent: idle
//     ^ a credit is stale here                 abort_step: idle
#include <memory>

#include <caf/local_actor.hpp>

#include "actors/runtime.hpp"

namespace troupe {

loader_actor spawn_data_loader_actor(caf::local_actor* supervisor, std::shared_ptr<const runtime_context> ctx,
                                     std::shared_ptr<const job_wiring> wiring, int replica);

}  // namespace troupe
