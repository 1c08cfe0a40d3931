#pragma once
// coordinator_actor: drives training step by step and ends the run.
//
//   run --> supervisors (one per node) report their actors --> wiring to every
//        supervisor --> begin_step(s) --> collect losses, partial norms
//        --> clip_factor --> collect stage_done / shard_done --> commit(s): metrics,
//        progress --> supervisor resets and checks every actor --> [evaluate, save]
//        --> begin_step(s+1) ... --> final state --> reply exit code
//   any runtime_failure, dead actor, leftover state or step timeout before the commit:
//   every supervisor rebuilds its actors from the state before the step, which runs again
//   (max_step_retries); a lost node process (not node 0) that the launcher restarts is
//   waited for (rejoin_timeout) and rebuilt from its buddy's copies. Otherwise: stop every
//   actor, reply 75 (a restart from the newest checkpoint can cure it) or 1.
#include <memory>

#include <caf/actor.hpp>
#include <caf/actor_system.hpp>

#include "actors/runtime.hpp"

namespace troupe {

/// Spawns the coordinator; send it `run_atom` to train; it answers with the exit code.
/// `supervisors`: one per node (remote ones through the middleman); empty: the
/// coordinator spawns one supervisor hosting the whole job in this process. `registrar`
/// (several nodes): where a lost node's restarted process rejoins.
caf::actor spawn_coordinator_actor(caf::actor_system& sys, std::shared_ptr<const runtime_context> ctx,
                                   std::shared_ptr<job_wiring> wiring, actor_run_options opts,
                                   std::shared_ptr<actor_run_result> result,
                                   std::vector<caf::actor> supervisors = {}, caf::actor registrar = {});

}  // namespace troupe
