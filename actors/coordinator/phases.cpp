// The coordinator's named behaviors, one per phase (actors/coordinator/state.hpp's `phase`; the
// diagram in actors/coordinator/coordinator.hpp). Each handles every message of coordinator_actor's
// interface: what a phase does not expect is dropped here, by name, so that no handler
// needs to ask which phase it is in.
#include "actors/coordinator/state.hpp"

#include <caf/all.hpp>
#include <spdlog/spdlog.h>

namespace troupe::coordinator {

namespace {

/// A message this phase does not expect (a step's report after its commit or while the
/// actors are rebuilt, an evaluation's outside one): dropped.
template <class Report>
auto drop(self_ptr self, const char* what) {
  return [self, what](const Report& msg) {
    spdlog::debug("coordinator ({}): {} of step {} dropped", phase_name(self->state.at), what, msg.step + 1);
  };
}

auto refuse_run() {
  return [](run_atom) -> caf::result<int> {
    return caf::make_error(caf::sec::runtime_error, std::string("the run has started already"));
  };
}

auto failures(self_ptr self) {
  return [self](const runtime_failure& msg) { on_failure(self, msg); };
}

auto watchdog(self_ptr self) {
  return [self](watchdog_atom) { on_watchdog(self); };
}

/// An evaluation's time limit, come after it ended.
auto no_eval_timeout() {
  return [](eval_atom, std::int64_t) {};
}

/// A step's time limit, come after its commit or abort.
auto no_step_timeout() {
  return [](timeout_atom, std::int64_t, std::int32_t) {};
}

/// A step runs: its reports count until the commit; its time limit holds.
coordinator_actor::behavior_type stepping_behavior(self_ptr self) {
  return {
      refuse_run(),
      [self](step_reports& msg) { counted(self, [&] { on_step_reports(self, msg); }); },
      failures(self),
      drop<eval_result>(self, "evaluation result"),
      no_eval_timeout(),
      watchdog(self),
      [self](timeout_atom, std::int64_t step, std::int32_t attempt) { on_step_timeout(self, step, attempt); },
  };
}

/// An evaluation runs through the pipeline: its forwards' scores count; its time limit holds.
coordinator_actor::behavior_type evaluating_behavior(self_ptr self) {
  return {
      refuse_run(),
      drop<step_reports>(self, "a node's reports"),
      failures(self),
      [self](const eval_result& msg) { on_eval_result(self, msg); },
      [self](eval_atom, std::int64_t step) { on_eval_timeout(self, step); },
      watchdog(self),
      no_step_timeout(),
  };
}

/// No step runs, so any report is stale; the continuations of the phase's requests move it
/// on. `run`: what a run request gets (idle: the run; wiring, between steps, rebuilding:
/// refused).
template <class Run>
coordinator_actor::behavior_type waiting_behavior(self_ptr self, Run run) {
  return {
      run,
      drop<step_reports>(self, "a node's reports"),
      failures(self),
      drop<eval_result>(self, "evaluation result"),
      no_eval_timeout(),
      watchdog(self),
      no_step_timeout(),
  };
}

}  // namespace

const char* phase_name(phase p) {
  switch (p) {
    case phase::idle: return "idle";
    case phase::wiring: return "wiring";
    case phase::stepping: return "stepping";
    case phase::between_steps: return "between steps";
    case phase::evaluating: return "evaluating";
    case phase::rebuilding: return "rebuilding";
    case phase::finished: return "finished";
  }
  return "?";
}

/// Spawned: the run request starts the job.
coordinator_actor::behavior_type idle(self_ptr self) {
  return waiting_behavior(self, [self](run_atom) { return on_run(self); });
}

void enter(self_ptr self, phase next) {
  auto& s = self->state;
  spdlog::debug("coordinator: {} -> {} (step {})", phase_name(s.at), phase_name(next), s.step + 1);
  s.at = next;
  switch (next) {
    case phase::idle: return self->become(idle(self));
    case phase::stepping: return self->become(stepping_behavior(self));
    case phase::evaluating: return self->become(evaluating_behavior(self));
    case phase::wiring:
    case phase::between_steps:
    case phase::rebuilding: return self->become(waiting_behavior(self, refuse_run()));
    case phase::finished: return;  // finish() quits
  }
}

}  // namespace troupe::coordinator
