#pragma once
// Every Troupe message type and atom in one CAF type-ID block. Load it with
// `cfg.add_message_types<caf::id_block::troupe>()` before starting an actor system.
#include <string>
#include <vector>

#include <caf/type_id.hpp>

#include "messages/node_messages.hpp"
#include "messages/optimizer_messages.hpp"
#include "messages/pipeline_messages.hpp"
#include "messages/step_messages.hpp"
#include "messages/tensor_payload.hpp"
#include "messages/wait_messages.hpp"

CAF_BEGIN_TYPE_ID_BLOCK(troupe, caf::first_custom_type_id)

  CAF_ADD_TYPE_ID(troupe, (troupe::tensor_payload))
  CAF_ADD_TYPE_ID(troupe, (troupe::begin_step))
  CAF_ADD_TYPE_ID(troupe, (troupe::trace_event))
  CAF_ADD_TYPE_ID(troupe, (std::vector<troupe::trace_event>))
  CAF_ADD_TYPE_ID(troupe, (troupe::stage_done))
  CAF_ADD_TYPE_ID(troupe, (troupe::shard_done))
  CAF_ADD_TYPE_ID(troupe, (troupe::reset_step))
  CAF_ADD_TYPE_ID(troupe, (troupe::reset_report))
  CAF_ADD_TYPE_ID(troupe, (std::vector<troupe::reset_report>))
  CAF_ADD_TYPE_ID(troupe, (troupe::abort_step))
  CAF_ADD_TYPE_ID(troupe, (troupe::runtime_failure))
  CAF_ADD_TYPE_ID(troupe, (troupe::state_reply))
  CAF_ADD_TYPE_ID(troupe, (troupe::shard_moments))
  CAF_ADD_TYPE_ID(troupe, (troupe::microbatch_input))
  CAF_ADD_TYPE_ID(troupe, (troupe::microbatch_target))
  CAF_ADD_TYPE_ID(troupe, (troupe::credit))
  CAF_ADD_TYPE_ID(troupe, (troupe::forward_activation))
  CAF_ADD_TYPE_ID(troupe, (troupe::backward_grad))
  CAF_ADD_TYPE_ID(troupe, (troupe::loss_report))
  CAF_ADD_TYPE_ID(troupe, (troupe::tied_grad))
  CAF_ADD_TYPE_ID(troupe, (troupe::grad_shard))
  CAF_ADD_TYPE_ID(troupe, (troupe::grad_norm_partial))
  CAF_ADD_TYPE_ID(troupe, (troupe::clip_factor_msg))
  CAF_ADD_TYPE_ID(troupe, (troupe::param_shard))
  CAF_ADD_TYPE_ID(troupe, (troupe::collective_done))
  CAF_ADD_TYPE_ID(troupe, (troupe::node_hello))
  CAF_ADD_TYPE_ID(troupe, (troupe::job_offer))
  CAF_ADD_TYPE_ID(troupe, (troupe::node_addresses))
  CAF_ADD_TYPE_ID(troupe, (troupe::node_ready))
  CAF_ADD_TYPE_ID(troupe, (troupe::node_actors))
  CAF_ADD_TYPE_ID(troupe, (troupe::wiring_msg))
  CAF_ADD_TYPE_ID(troupe, (troupe::shard_copy))
  CAF_ADD_TYPE_ID(troupe, (std::vector<troupe::shard_copy>))
  CAF_ADD_TYPE_ID(troupe, (troupe::node_unfit))
  CAF_ADD_TYPE_ID(troupe, (troupe::eval_activation))
  CAF_ADD_TYPE_ID(troupe, (troupe::eval_target))
  CAF_ADD_TYPE_ID(troupe, (troupe::eval_result))
  CAF_ADD_TYPE_ID(troupe, (troupe::written_file))
  CAF_ADD_TYPE_ID(troupe, (std::vector<troupe::written_file>))
  CAF_ADD_TYPE_ID(troupe, (troupe::write_checkpoint))
  CAF_ADD_TYPE_ID(troupe, (troupe::stage_checkpoint))
  CAF_ADD_TYPE_ID(troupe, (troupe::wait_report))
  CAF_ADD_TYPE_ID(troupe, (std::vector<troupe::wait_report>))
  CAF_ADD_TYPE_ID(troupe, (troupe::step_reports))

  // Atoms (at most 10 characters).
  CAF_ADD_ATOM(troupe, troupe, run_atom, "run")
  CAF_ADD_ATOM(troupe, troupe, state_atom, "state")
  CAF_ADD_ATOM(troupe, troupe, timeout_atom, "timeout")
  CAF_ADD_ATOM(troupe, troupe, plant_atom, "plant")
  CAF_ADD_ATOM(troupe, troupe, check_atom, "check")
  CAF_ADD_ATOM(troupe, troupe, recover_atom, "recover")
  CAF_ADD_ATOM(troupe, troupe, gathered_atom, "gathered")
  CAF_ADD_ATOM(troupe, troupe, rejoin_atom, "rejoin")
  CAF_ADD_ATOM(troupe, troupe, buddy_atom, "buddy")
  CAF_ADD_ATOM(troupe, troupe, copied_atom, "copied")
  CAF_ADD_ATOM(troupe, troupe, clock_atom, "clock")
  CAF_ADD_ATOM(troupe, troupe, eval_atom, "eval")
  CAF_ADD_ATOM(troupe, troupe, wait_atom, "wait")
  CAF_ADD_ATOM(troupe, troupe, watchdog_atom, "watchdog")
  CAF_ADD_ATOM(troupe, troupe, activity_atom, "activity")
  CAF_ADD_ATOM(troupe, troupe, durable_atom, "durable")

CAF_END_TYPE_ID_BLOCK(troupe)
