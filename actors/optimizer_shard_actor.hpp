#pragma once
// optimizer_shard_actor: rank j of the d shards of one pipeline stage. Owns range j of
// each of the stage's chunk buffers: fp32 main parameters and AdamW moments (1/d of the
// stage's optimizer state).
//
//        begin_step        d x v grad_shard          clip_factor_msg
//   idle ----------> wait ------------------> reduced -------------> updated (param_shard
//     ^           (sum replicas in order,   (partial norm sent)     to every replica,
//     |            reduce-scatter)                                  shard_done)
//     +------------------------------ reset_step ----------------------------+
#include <memory>

#include <caf/actor.hpp>
#include <caf/event_based_actor.hpp>

#include "actors/runtime.hpp"

namespace troupe {

/// Spawns shard `rank` of `stage`, monitored by `supervisor`.
caf::actor spawn_optimizer_shard_actor(caf::event_based_actor* supervisor, std::shared_ptr<const runtime_context> ctx,
                                       std::shared_ptr<const job_wiring> wiring, int stage, int rank);

}  // namespace troupe
