#pragma once
// A stage's files of a checkpoint folder, written synchronously or in the background
// (output.checkpoint_async): a snapshot of the stage's parameters and optimizer state in
// host memory, taken at the step boundary, and a writer actor whose thread writes it while
// training goes on. The writer answers durable_atom with the files (stage_checkpoint) once
// they are durable (fsync, rename of each file) and quits.
//
// The snapshots a process holds are bounded (output.checkpoint_async_memory, else half
// of the host's available memory): one over the bound is not taken, and the stage writes
// its files before answering, as without checkpoint_async.
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include <caf/actor.hpp>
#include <caf/local_actor.hpp>

#include "compute/checkpoint/checkpoint.hpp"
#include "messages/step_messages.hpp"

namespace troupe {

/// What a stage writes into a checkpoint's temporary folder (its two files), or an
/// optimizer shard (`shard` >= 0: its one file, `params` its pieces: write_shard_file).
struct stage_files {
  std::string folder;
  int stage = 0;
  state_dict params, optim;
  int shard = -1;
};

/// Writes `files` (write_stage_files): the answer with its files or the error, and the
/// trace event "checkpoint write" made from `event` (its times from `now_us`).
stage_checkpoint write_files(const stage_files& files, trace_event event, const std::function<double()>& now_us);

/// The bytes of `files`' tensors.
std::int64_t snapshot_bytes(const stage_files& files);

/// Reserves `bytes` of this process's snapshot memory (`limit_mib` > 0: the bound in
/// MiB for all its snapshots in flight; 0: half of MemAvailable now). Empty when
/// reserved (release_snapshot gives it back), else why not.
std::string reserve_snapshot(std::int64_t bytes, int limit_mib);
void release_snapshot(std::int64_t bytes);

/// A copy of `files`' tensors, owned by nobody else (the live parameters and moments
/// go on changing).
stage_files copy_snapshot(const stage_files& files);

/// Spawns the writer of `snapshot` (whose `bytes` were reserved, released once written).
/// `kill_after` (faults.kill_in_write): the process SIGKILLs itself that many seconds
/// after the write begins (`node`: named in the log).
caf::actor spawn_checkpoint_writer(caf::local_actor* parent, stage_files snapshot, std::int64_t bytes,
                                   trace_event event, std::function<double()> now_us,
                                   std::optional<double> kill_after, int node);

/// How long a process that ends waits for its background writes (the coordinator's
/// limit for a stage's files).
constexpr double checkpoint_write_seconds = 600;

/// Waits (up to `seconds`) until no background write of this process is running: a
/// process ending with one (a run that failed meanwhile) lets it finish first. No
/// kill_in_write fault of the writes begun before fires after it.
void await_checkpoint_writes(double seconds);

}  // namespace troupe
