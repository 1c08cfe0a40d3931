#pragma once
// The single-process trainer: d replicas of a p-stage pipeline in one process, run in
// schedule order, with Megatron's sharded optimizer emulated in memory (reduce-scatter
// of each stage's flat grad buffer, one AdamW shard per stage per replica, global-norm
// clipping from per-shard partial norms, all-gather of the updated parameters).
// It is the reference the actor runtime is checked against.
#include <functional>
#include <map>
#include <memory>
#include <optional>

#include "compute/checkpoint/training_state.hpp"
#include "compute/config/job_config.hpp"
#include "compute/data/training_data.hpp"
#include "compute/optim/grad_buffer.hpp"
#include "compute/optim/optimizer.hpp"
#include "compute/parallel/collective_group.hpp"
#include "compute/schedule/schedule.hpp"
#include "compute/trainer/evaluation.hpp"
#include "compute/trainer/local_pipeline.hpp"
#include "compute/trainer/progress.hpp"

namespace troupe {

class local_trainer {
 public:
  /// Initial weights: `init` if given, else the file cfg.init, else initial_state(seed).
  /// Tensor parallelism (parallel.tensor_parallel = T > 1): each replica is T pipelines,
  /// one per tensor-parallel rank, each run on a thread of its own in every step and
  /// evaluation, over a group that `groups` makes (config_error without one).
  explicit local_trainer(const job_config& cfg, std::optional<state_dict> init = std::nullopt,
                         const group_factory& groups = {});

  /// Runs optimizer step `next_step()`.
  step_stats step();
  int next_step() const { return next_step_; }

  /// gpt: validation loss; mlp: test loss and accuracy (replica 0's parameters).
  evaluation evaluate();

  /// Full-model parameters (replica 0), canonical order.
  state_dict state() const;
  /// AdamW state by parameter name: "exp_avg.<name>", "exp_avg_sq.<name>", and "step".
  state_dict optimizer_state() const;

  /// FILE: model state_dict (PyTorch); FILE.optim: optimizer state and the next step.
  void save_checkpoint(const std::string& path) const;
  /// Restores both files of save_checkpoint (any layout: state is kept by name).
  void load_checkpoint(const std::string& path);

  const job_config& config() const { return cfg_; }
  /// Replica r's pipeline (tensor parallelism: of rank `tp`).
  local_pipeline& replica(int r, int tp = 0) { return *replicas_.at(std::size_t(r * tp_ + tp)); }

 private:
  /// Runs `fn(r, t)` for every tensor-parallel rank t of replicas [first, first + count),
  /// each on a thread of its own (one in all: on this one); an exception on one aborts
  /// their groups (the others would wait in a collective for ever) and is rethrown.
  void together(int first, int count, const std::function<void(int replica, int tp)>& fn);
  /// Sums the gradients of the parameters every tensor-parallel rank of a replica holds
  /// whole over the ranks (sequence parallelism: each computed its positions' share).
  void sum_replicated_grads(int replica);

  /// One range of one virtual stage's buffers and its optimizer state: a range of the
  /// dense region, summed over the data-parallel group (one tensor-parallel rank's
  /// replicas), or of the expert region, summed over the expert-data-parallel group (the
  /// ranks q with the same q mod EP).
  struct shard {
    int virtual_stage = 0;
    std::vector<int> members;  ///< the ranks q = r T + t whose buffers it sums and updates
    flat_range range;
    bool experts = false;
    adamw_shard opt;
    torch::Tensor norm_mask;
    int tp(int tp_size) const { return members.front() % tp_size; }
  };

  job_config cfg_;
  model_spec spec_;
  schedule sched_;
  lr_schedule lrs_;
  training_data data_;
  int tp_ = 1;                                             ///< tensor-parallel ranks
  int ep_ = 1;                                             ///< expert-parallel ranks per group
  int ep_block_ = 1;  ///< replicas an expert-parallel group's ranks span: EP / gcd(EP, T)
  std::vector<std::vector<std::shared_ptr<collective_group>>> groups_;  ///< per replica, per rank
  std::vector<std::vector<std::shared_ptr<collective_group>>> ep_groups_;  ///< per group, per member
  std::vector<std::unique_ptr<local_pipeline>> replicas_;  ///< [replica * tp_ + rank]
  std::vector<shard> shards_;
  int next_step_ = 0;
};

/// `troupe train`: the training loop with progress lines, metrics, evaluation and
/// checkpoints. Returns the process exit code. `stop_requested` (when given) is asked
/// after each step: a signal number ends the run there, with a checkpoint (cfg.save) and
/// exit_stopped.
/// `groups`: what tensor-parallel jobs compute over (see local_trainer).
int run_training(const job_config& cfg, const std::function<int()>& stop_requested = {},
                 const group_factory& groups = {});

}  // namespace troupe
