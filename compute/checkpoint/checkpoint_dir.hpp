#pragma once
// Checkpoint folders: what a run writes every `checkpoint_interval` steps and at the end
// (output.checkpoint_dir), and what `--resume` continues from.
//
//   DIR/step-00000010/manifest.json     step, data position, layout, the training config
//                                       (and its hash), every file with its size and CRC-32
//   DIR/step-00000010/stage-K.pt        stage K's parameters (PyTorch state_dict, GPT-2 names)
//   DIR/step-00000010/optim-stage-K.pt  stage K's AdamW moments ("step", "exp_avg.NAME",
//                                       "exp_avg_sq.NAME"), assembled from its shards
//   DIR/step-00000010/stage-K-shard-P.pt  with parameters sharded (parallel.shard =
//                                       "parameters"): instead of the two above, each
//                                       optimizer shard's own pieces (shard_file_state)
//   DIR/latest                          the name of the newest complete step folder
//
// A step folder is written under a temporary name and renamed when complete (atomic);
// `latest` is replaced atomically after it. The newest `keep` folders stay.
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "compute/checkpoint/checkpoint.hpp"
#include "compute/config/job_config.hpp"
#include "compute/models/model.hpp"
#include "compute/checkpoint/training_state.hpp"

namespace troupe {

// Writing a step folder takes three calls, so that each stage can write its own files
// from its own process (the distributed runtime: no process gathers the whole model):
// begin_checkpoint_dir creates the temporary folder, write_stage_files writes a stage's
// files into it, finish_checkpoint_dir writes the manifest and renames the folder.

/// Creates the temporary folder of step `next_step`'s checkpoint in `root` (and `root`),
/// empty (a leftover of a write that failed is removed), and returns it. Throws
/// checkpoint_error.
std::string begin_checkpoint_dir(const std::string& root, std::int64_t next_step);

/// Writes stage `stage`'s parameters (stage-K.pt) and optimizer state (optim-stage-K.pt)
/// into the temporary folder `tmp`; returns their manifest entries. Throws
/// checkpoint_error.
std::vector<checkpoint_file> write_stage_files(const std::string& tmp, int stage, const state_dict& params,
                                               const state_dict& optim);

/// A shard's file of a checkpoint folder: its pieces of the parameters' fp32 main values
/// and AdamW moments, each a flat tensor keyed "KIND.NAME@OFFSET/NUMEL" (KIND: "main",
/// "exp_avg" or "exp_avg_sq"; elements [OFFSET, OFFSET + its numel) of the flat
/// parameter, or of the tensor-parallel rank's part of it, of NUMEL elements), and
/// "step" (the step it continues with), "tensor_parallel_rank", "tensor_parallel_size".
state_dict shard_file_state(const std::vector<moment_piece>& pieces, int tp_rank, int tp_size,
                            std::int64_t next_step);

/// Writes shard `shard` of stage `stage`'s file (stage-K-shard-P.pt, shard_file_state)
/// into the temporary folder `tmp`; returns its manifest entry. Throws checkpoint_error.
checkpoint_file write_shard_file(const std::string& tmp, int stage, int shard, const state_dict& pieces);

/// Completes step `next_step`'s checkpoint: every stage of `cfg`'s pipeline must have its
/// two files (or, written by its shards, at least one shard file) in the temporary folder, with the sizes `files` gives (a stage on another
/// host writes through checkpoint_dir, which must be a folder every node shares); writes
/// the manifest, renames the folder to its final name, replaces `latest`, keeps the
/// newest `keep` step folders. Returns the step folder. Throws checkpoint_error, having
/// removed the temporary folder.
std::string finish_checkpoint_dir(const std::string& root, const job_config& cfg,
                                  const std::vector<checkpoint_file>& files, std::int64_t next_step, int keep);

/// Removes the temporary folder of a checkpoint that will not be finished.
void abandon_checkpoint_dir(const std::string& root, std::int64_t next_step);

/// The step folder `path` names: a step folder itself (it holds manifest.json) or a
/// checkpoint root (its `latest`, or without a usable one its newest complete step
/// folder). Throws checkpoint_error when there is none.
std::string find_checkpoint(const std::string& path);

/// Reads a step folder for a run of `cfg` (in any layout and shard level, whichever wrote
/// it; shard files are put together by name): verifies every file's size and CRC-32, that
/// the training configuration is the one that wrote it (the keys that differ are named)
/// and that the parameters fit `cfg`'s model. Throws checkpoint_error. With `keep`, only
/// the parameters it keeps (by name) and their moments are returned: the files are read
/// one at a time and every one is still checked, but no more than one file's tensors and
/// the kept ones are held at once (a node process takes only its stages' share).
checkpoint read_checkpoint_dir(const std::string& folder, const job_config& cfg,
                               const std::function<bool(const std::string&)>& keep = {});

/// The training configuration a step folder's manifest records (the keys of
/// training_identity; the others at their defaults): the model it holds, for tools that
/// read a checkpoint without a job (`troupe generate`). Throws checkpoint_error.
job_config checkpoint_job_config(const std::string& folder);

/// What a --save file of a run of `cfg` records of its model, as TOML: the workload,
/// train.model, the [model] keys as they resolve and the tokenizer (training_identity's).
std::string saved_model_toml(const job_config& cfg);
/// The configuration of the model --save file `path` records (saved_model_toml; the other
/// keys at their defaults); nullopt for a file without a record (torch.save's own, or
/// Troupe's before the record). Throws checkpoint_error for a record that does not parse.
std::optional<job_config> saved_model_config(const std::string& path);

/// The keys whose values decide the numbers a run computes (model, data, optimizer, lr
/// schedule), as (key, value) text; the layout (pipeline, data-parallel, ...) is not one.
std::vector<std::pair<std::string, std::string>> training_identity(const job_config& cfg);

/// Resolves `cfg.resume` in place: "auto" is the newest checkpoint of cfg.checkpoint_dir
/// (none yet: "", a fresh start); a checkpoint root becomes its newest step folder; a
/// step folder stays. With `restarted` (launch_info::resume_auto: the launcher restarts
/// the job) the newest checkpoint of checkpoint_dir wins over the configured one. Taken
/// from a root, a step folder must verify (every file's size and CRC-32): the newest one
/// that does not is moved aside (corrupt-step-N, with a warning) and the next older one
/// taken, unless cfg.strict_resume, which refuses it (moved aside only in the job's own
/// checkpoint_dir, and only once a folder that verifies is found). Throws checkpoint_error
/// (a root whose checkpoints all fail to verify is refused, not started afresh over).
void resolve_resume(job_config& cfg, bool restarted);

/// A run whose checkpoint to continue from (cfg.resume, resolved) is already at its last
/// step: logs that it is complete and writes output.save from that checkpoint where the
/// job has one; true then (nothing to train). Throws checkpoint_error.
bool report_complete_run(const job_config& cfg);

/// Locks checkpoint folder `dir` for this process (flock on DIR/.lock, which records its
/// pid and host; the kernel releases it when the process ends, however it ends): a second
/// job on the same folder is refused (config_error) instead of overwriting this one's
/// checkpoints, after up to `wait_seconds` of trying again. Again for the same folder:
/// nothing. A file system that cannot lock: a warning. check_output_paths takes it.
void lock_checkpoint_dir(const std::string& dir, double wait_seconds = 0);

/// The files and folders a run will write (output.save and its ".optim" beside it, metrics, trace,
/// checkpoint_dir, which is created and locked: lock_checkpoint_dir) can be written: a
/// missing or read-only folder, or a file path that is a folder, is a config_error naming
/// the key now, not a failure after the training it would lose. A folder short of the
/// space a save or checkpoint takes is warned about. `lock_wait_seconds`: see
/// lock_checkpoint_dir (a restarted job's).
void check_output_paths(const job_config& cfg, double lock_wait_seconds = 0);

}  // namespace troupe
