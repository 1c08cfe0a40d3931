#pragma once
// The protocol of every actor kind: the messages it takes and what it answers, as CAF
// typed handles. Sending a kind a message it does not take, or reading an answer of the
// wrong type, is a compile error. Messages that cross node processes carry plain
// `caf::actor` handles (node_messages.hpp); the receiver casts them to these.
#include <cstdint>
#include <string>
#include <vector>

#include <caf/actor.hpp>
#include <caf/replies_to.hpp>
#include <caf/typed_actor.hpp>

#include "messages/type_ids.hpp"

namespace troupe {

/// What every actor of a step takes: its start, the supervisor's reset between steps
/// (answered with what it still held), the hang probe (what it waits for) and an abort.
using step_actor = caf::typed_actor<caf::reacts_to<begin_step>,                                //
                                    caf::replies_to<reset_step>::with<reset_report>,           //
                                    caf::replies_to<wait_atom, std::int64_t>::with<wait_report>,  //
                                    caf::reacts_to<abort_step>>;

/// A pipeline's data loader (data_loader_actor.hpp): micro-batches to its first and last
/// stages, one more for each credit.
using loader_actor = step_actor::extend<caf::reacts_to<credit>>;

/// A stage (stage_actor.hpp): micro-batches, activations and gradients in; its updated
/// parameters from its optimizer shards; evaluation forwards; its state and checkpoint
/// files on request. `run_atom`: a weight-gradient turn it sent itself (dataflow);
/// `run_atom, n`: the end of its n-th modelled op (train.compute simulated: actors/simulated/);
/// `plant_atom`: tests plant a stray tensor the next reset must report.
using stage_actor = step_actor::extend<caf::reacts_to<microbatch_input>,                                //
                                       caf::reacts_to<microbatch_target>,                               //
                                       caf::reacts_to<forward_activation>,                              //
                                       caf::reacts_to<backward_grad>,                                   //
                                       caf::reacts_to<tied_grad>,                                       //
                                       caf::reacts_to<param_shard>,                                     //
                                       caf::reacts_to<eval_activation>,                                 //
                                       caf::reacts_to<eval_target>,                                     //
                                       caf::replies_to<eval_atom, std::int64_t>::with<std::vector<trace_event>>,  //
                                       caf::reacts_to<run_atom>,                                        //
                                       caf::reacts_to<run_atom, std::int64_t>,                          //
                                       caf::replies_to<state_atom>::with<state_reply>,                  //
                                       caf::replies_to<write_checkpoint>::with<stage_checkpoint>,       //
                                       caf::reacts_to<plant_atom>>;

/// An optimizer shard (optimizer_shard_actor.hpp): its stage's gradient buffer, its
/// communicator's completions, the global clip factor; its moments on request.
using shard_actor = step_actor::extend<caf::reacts_to<grad_shard>,       //
                                       caf::reacts_to<collective_done>,  //
                                       caf::reacts_to<clip_factor_msg>,  //
                                       caf::replies_to<state_atom>::with<shard_moments>,
                                       caf::replies_to<write_checkpoint>::with<stage_checkpoint>>;

/// The coordinator (coordinator_actor.hpp): `run_atom` trains and answers the exit code;
/// the step's reports, batched by each node's supervisor; its own watchdog ticks and
/// timeouts.
using coordinator_actor = caf::typed_actor<caf::replies_to<run_atom>::with<int>,                //
                                           caf::reacts_to<step_reports>,                        //
                                           caf::reacts_to<runtime_failure>,                     //
                                           caf::reacts_to<eval_result>,                         //
                                           caf::reacts_to<eval_atom, std::int64_t>,             //
                                           caf::reacts_to<watchdog_atom>,                       //
                                           caf::reacts_to<timeout_atom, std::int64_t, std::int32_t>>;

/// A node's supervisor (supervisor_actor.hpp): its actors once spawned, the job's wiring,
/// in-place recovery (from the state before the step, or a lost node's from its buddy),
/// buddy copies of the previous node's shards, the reset check between steps, the
/// threads' activity for the hang probe. The step's relay: begin_step and the clip factor
/// from the coordinator to its actors, their reports batched back (step_reports).
using supervisor_actor =
    caf::typed_actor<caf::replies_to<run_atom>::with<node_actors>,                                       //
                     caf::reacts_to<begin_step>,                                                        //
                     caf::reacts_to<clip_factor_msg>,                                                   //
                     caf::reacts_to<loss_report>,                                                       //
                     caf::reacts_to<grad_norm_partial>,                                                 //
                     caf::reacts_to<stage_done>,                                                        //
                     caf::reacts_to<shard_done>,                                                        //
                     caf::replies_to<recover_atom, std::int64_t, std::int32_t>::with<node_actors>,      //
                     caf::replies_to<recover_atom, std::int64_t, std::int32_t, caf::actor>::with<node_actors>,  //
                     caf::replies_to<shard_copy>::with<bool>,                                           //
                     caf::reacts_to<copied_atom, std::uint64_t>,                                        //
                     caf::replies_to<buddy_atom, std::int64_t>::with<std::vector<shard_copy>>,          //
                     caf::reacts_to<gathered_atom, std::int32_t, std::string>,                          //
                     caf::replies_to<wiring_msg>::with<bool>,                                           //
                     caf::replies_to<check_atom, reset_step>::with<std::vector<reset_report>>,          //
                     caf::reacts_to<abort_step>,                                                        //
                     caf::replies_to<activity_atom, std::int64_t>::with<std::vector<wait_report>>,      //
                     caf::reacts_to<plant_atom, int, int>>;

/// Node 0's registrar (registrar_actor.hpp): nodes join, exchange addresses, report ready
/// or unfit; a lost node's restarted process rejoins; node 0's coordinator waits for every
/// node (`run_atom`: their supervisors); clock probes; fencing checks it sent itself.
using registrar_actor =
    caf::typed_actor<caf::replies_to<clock_atom>::with<std::int64_t>,                              //
                     caf::reacts_to<check_atom, std::int32_t, std::int32_t>,                       //
                     caf::replies_to<node_hello>::with<job_offer>,                                 //
                     caf::replies_to<node_addresses>::with<node_addresses>,                        //
                     caf::replies_to<node_ready>::with<bool>,                                      //
                     caf::replies_to<rejoin_atom, std::int32_t, caf::actor>::with<caf::actor>,     //
                     caf::replies_to<node_unfit>::with<bool>,                                      //
                     caf::replies_to<run_atom>::with<std::vector<caf::actor>>>;

/// A node's clock probe (clock_probe_actor.hpp): its own ticks, one probe round each.
using clock_probe_actor = caf::typed_actor<caf::reacts_to<timeout_atom>>;

/// Casts plain handles (from a message that crossed processes) to kind `Handle`.
template <class Handle>
std::vector<Handle> typed_handles(const std::vector<caf::actor>& xs) {
  std::vector<Handle> out;
  out.reserve(xs.size());
  for (const auto& x : xs) out.push_back(caf::actor_cast<Handle>(x));
  return out;
}

/// Plain handles of `xs`, for a message that crosses processes.
template <class Handle>
std::vector<caf::actor> plain_handles(const std::vector<Handle>& xs) {
  std::vector<caf::actor> out;
  out.reserve(xs.size());
  for (const auto& x : xs) out.push_back(caf::actor_cast<caf::actor>(x));
  return out;
}

}  // namespace troupe
