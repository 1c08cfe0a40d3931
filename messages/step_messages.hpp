#pragma once
// The step as a transaction: begin, per-actor completion, commit, reset, abort.
#include <cstdint>
#include <string>
#include <vector>

#include <caf/actor.hpp>
#include <caf/meta/type_name.hpp>

#include "messages/optimizer_messages.hpp"
#include "messages/pipeline_messages.hpp"
#include "messages/tensor_payload.hpp"

namespace troupe {

/// Coordinator -> every actor: step `step` starts at learning rate `lr`.
struct begin_step {
  std::int64_t step = 0;
  double lr = 0;
  std::int32_t attempt = 0;  ///< 0, or how often this step was retried in place
};

/// One executed operation, for the Chrome trace and the measured bubble.
struct trace_event {
  std::string name;        ///< "F", "B", "send activation", "recv gradient", ..., "reduce-scatter", ...
  std::int32_t replica = 0;
  std::int32_t stage = -1; ///< pipeline stage (track); -1 for non-stage actors
  std::int32_t mb = -1;     ///< micro-batch; a reduce-scatter: its gradient bucket
  std::int32_t chunk = -1;
  std::int64_t step = 0;
  double start_us = 0;     ///< microseconds since the run's epoch
  double end_us = 0;
  std::int64_t bytes = -1; ///< tensor sends/receives: the tensor's bytes; collectives: the buffer's or bucket's; -1: none
};

/// Stage -> coordinator: the stage ran all its ops and received its updated parameters.
struct stage_done {
  std::int64_t step = 0;
  std::int32_t replica = 0;
  std::int32_t stage = 0;
  std::int32_t peak_in_flight = 0;  ///< max micro-batches forwarded, not yet backwarded
  std::vector<trace_event> events;
  double aux_loss = 0;  ///< experts: the load-balancing loss its forwards added, each times its weight
  /// Experts: its blocks' choices per expert, flat: for each expert block, its index then
  /// one count per expert.
  std::vector<std::int64_t> expert_tokens;
};

/// Optimizer shard -> coordinator: update done and parameters sent.
struct shard_done {
  std::int64_t step = 0;
  std::int32_t stage = 0;
  std::int32_t rank = 0;
  std::vector<trace_event> events;
};

/// A node's supervisor -> coordinator: its actors' reports of a step, batched. The
/// stages, shards and loaders of a node report to their supervisor, which sends what it
/// holds once all of its shards' gradient-norm partials are in, once all of its stages
/// are done, once all of its shards are done, and when the hang probe asks (activity_atom):
/// the coordinator takes a few messages per node and step, not several per rank.
struct step_reports {
  std::int64_t step = 0;
  std::int32_t attempt = 0;  ///< of the begin_step the supervisor forwarded
  std::int32_t node = 0;
  std::vector<loss_report> losses;
  std::vector<grad_norm_partial> partials;
  std::vector<stage_done> stages;
  std::vector<shard_done> shards;

  bool empty() const { return losses.empty() && partials.empty() && stages.empty() && shards.empty(); }
};

/// Coordinator -> actors: drop all per-step state of `step`.
struct reset_step {
  std::int64_t step = 0;
};

/// Actor -> supervisor: what the actor still held after a reset (empty: nothing).
struct reset_report {
  std::string actor;
  std::vector<std::string> leftovers;
};

/// Coordinator -> actors: step `step` is abandoned.
struct abort_step {
  std::int64_t step = 0;
  std::string reason;
};

/// Any actor -> coordinator: something went wrong in `step` (bad payload, ...).
struct runtime_failure {
  std::int64_t step = 0;
  std::string actor;
  std::string what;
  /// The sender's actor generation (job_wiring::generation): the coordinator drops
  /// failures of actors that an in-place recovery has replaced since.
  std::int32_t generation = 0;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, begin_step& x) {
  return f(caf::meta::type_name("begin_step"), x.step, x.lr, x.attempt);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, trace_event& x) {
  return f(caf::meta::type_name("trace_event"), x.name, x.replica, x.stage, x.mb, x.chunk, x.step,
           x.start_us, x.end_us, x.bytes);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, stage_done& x) {
  return f(caf::meta::type_name("stage_done"), x.step, x.replica, x.stage, x.peak_in_flight, x.events, x.aux_loss,
                            x.expert_tokens);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, shard_done& x) {
  return f(caf::meta::type_name("shard_done"), x.step, x.stage, x.rank, x.events);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, step_reports& x) {
  return f(caf::meta::type_name("step_reports"), x.step, x.attempt, x.node, x.losses, x.partials, x.stages, x.shards);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, reset_step& x) {
  return f(caf::meta::type_name("reset_step"), x.step);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, reset_report& x) {
  return f(caf::meta::type_name("reset_report"), x.actor, x.leftovers);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, abort_step& x) {
  return f(caf::meta::type_name("abort_step"), x.step, x.reason);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, runtime_failure& x) {
  return f(caf::meta::type_name("runtime_failure"), x.step, x.actor, x.what, x.generation);
}

}  // namespace troupe

namespace troupe {

/// Stage -> coordinator: the stage's parameters by name (checkpoints, the run's end, and
/// evaluation with eval_mode gather).
struct state_reply {
  std::vector<std::string> names;
  std::vector<tensor_payload> tensors;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, state_reply& x) {
  return f(caf::meta::type_name("state_reply"), x.names, x.tensors);
}

/// Optimizer shard -> coordinator or checkpoint-writing stage: the shard's own pieces of
/// its parameters' optimizer state (moment_piece: entry i is elements [offsets[i],
/// offsets[i] + tensors[i]'s) of a flat parameter of numels[i] elements).
struct shard_moments {
  std::vector<std::string> names;  ///< "exp_avg.NAME", "exp_avg_sq.NAME", "main.NAME"
  std::vector<std::int64_t> offsets, numels;
  std::vector<tensor_payload> tensors;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, shard_moments& x) {
  return f(caf::meta::type_name("shard_moments"), x.names, x.offsets, x.numels, x.tensors);
}

/// Coordinator -> replica 0's stage K: write your files of a checkpoint folder into its
/// temporary folder `folder` (the stage gathers its optimizer state from its shards).
/// `background` (output.checkpoint_async): take a snapshot in host memory and answer at
/// once, the files written by a writer actor of the stage's process while training goes
/// on (its handle in the answer), unless the snapshot is over the host-memory bound.
struct write_checkpoint {
  std::string folder;
  std::int64_t step = 0;  ///< the steps the checkpoint has finished
  bool background = false;
};

/// A file a stage wrote into a checkpoint folder (compute/checkpoint/checkpoint.hpp's checkpoint_file).
struct written_file {
  std::string name;  ///< in the step folder: "stage-K.pt", "optim-stage-K.pt"
  std::int32_t stage = 0;
  std::string kind;  ///< "parameters" or "optimizer"
  std::uint64_t bytes = 0;
  std::uint32_t crc32 = 0;
};

/// Stage -> coordinator: the files it wrote, or why it could not, and the trace events
/// of its work ("checkpoint gather": its shards' state; "checkpoint snapshot": its copy in
/// host memory; "checkpoint write": its files). A background write: `writer` is set and
/// `files` empty; the writer answers durable_atom with the files once they are durable
/// (fsync, rename) and quits.
struct stage_checkpoint {
  std::vector<written_file> files;
  std::string error;
  std::vector<trace_event> events;
  caf::actor writer;
  std::int64_t snapshot_bytes = 0;  ///< the snapshot's host memory (a background write)
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, written_file& x) {
  return f(caf::meta::type_name("written_file"), x.name, x.stage, x.kind, x.bytes, x.crc32);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, write_checkpoint& x) {
  return f(caf::meta::type_name("write_checkpoint"), x.folder, x.step, x.background);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, stage_checkpoint& x) {
  return f(caf::meta::type_name("stage_checkpoint"), x.files, x.error, x.events, x.writer, x.snapshot_bytes);
}

}  // namespace troupe
