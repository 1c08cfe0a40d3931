#pragma once
// coordinator_actor: drives training step by step and ends the run. Its phases are
// named behaviors (actors/coordinator/phases.cpp), switched with become():
//
//   idle --run--> wiring --every node's actors wired--> stepping --every report in:
//   commit--> between steps (reset check) [--> evaluating -->] (checkpoint) --> stepping
//   ... --> finished: the exit code answers the run request
//
//   wiring: the supervisors (one per node) report their actors; the wiring goes to every
//     supervisor, then begin_step(s).
//   stepping: losses and gradient-norm partials come in, clip_factor goes to the shards,
//     stage_done / shard_done come in; the step's time limit and the hang watchdog hold.
//   between steps: the supervisors reset and check every actor; evaluation and
//     checkpoints when due; a report that comes now is stale and dropped.
//   any runtime_failure, dead actor, leftover state, hang or step timeout before the
//   commit: rebuilding: every supervisor rebuilds its actors from the state before the
//   step, which runs again (max_step_retries) after wiring; a lost node process (not
//   node 0) that the launcher restarts is waited for (rejoin_timeout) and rebuilt from
//   its buddy's copies. Otherwise: finished: stop every actor, answer 75 (a restart from
//   the newest checkpoint can cure it) or 1.
#include <memory>

#include <caf/actor_system.hpp>

#include "actors/runtime.hpp"

namespace troupe {

/// Spawns the coordinator; send it `run_atom` to train; it answers with the exit code.
/// `supervisors`: one per node (remote ones through the middleman); empty: the
/// coordinator spawns one supervisor hosting the whole job in this process. `registrar`
/// (several nodes): where a lost node's restarted process rejoins.
coordinator_actor spawn_coordinator_actor(caf::actor_system& sys, std::shared_ptr<const runtime_context> ctx,
                                          std::shared_ptr<job_wiring> wiring, actor_run_options opts,
                                          std::shared_ptr<actor_run_result> result,
                                          std::vector<supervisor_actor> supervisors = {},
                                          registrar_actor registrar = {});

}  // namespace troupe
