#pragma once
// optimizer_shard_actor: rank j of the d shards of one pipeline stage, in the process of
// replica j's stage actor. Owns range j of each of the stage's chunk buffers: fp32 main
// parameters and AdamW moments (1/d of the stage's optimizer state). With experts sharded
// over expert-parallel ranks, the chunks' expert regions are reduced, updated and gathered
// over the expert-data-parallel group instead (grad_buffer.hpp's shard_groups). The d shards of a
// stage share a transport::communicator (local in one process, UCX across processes);
// completions of its collectives come back to the actor as collective_done messages.
//
//        begin_step      v grad_shard            reduce-scatter done        clip_factor_msg
//   idle ----------> wait -----------> reducing ------------------> reduced -------------->
//     ^            (own stage's       (comm.reduce_scatter        (partial norm
//     |             buffers)           per chunk)                  to coordinator)
//     |   all-gather done: param_shard (whole buffer) to own stage, shard_done
//     +<------------ gathering (update, comm.all_gather per chunk) <---------+
//     reset_step: drops the step's state (a collective still running is a leftover)
#include <memory>

#include <caf/local_actor.hpp>

#include "actors/runtime.hpp"
#include "actors/snapshot.hpp"
#include "transport/transport.hpp"

namespace troupe {

/// Spawns shard `rank` of `stage`, monitored by `supervisor`; `comm` is rank `rank` of the
/// stage's d shards (of its tensor-parallel rank); `expert_comm` (expert parallelism, else
/// null) rank rank / EP of the shards of the pipelines holding the same experts.
shard_actor spawn_optimizer_shard_actor(caf::local_actor* supervisor, std::shared_ptr<const runtime_context> ctx,
                                        std::shared_ptr<const job_wiring> wiring, int stage, int rank,
                                        std::shared_ptr<transport::communicator> comm,
                                        std::shared_ptr<transport::communicator> expert_comm,
                                        std::shared_ptr<snapshot_store> store,
                                        std::shared_ptr<const shard_snapshot> from = nullptr);

}  // namespace troupe
