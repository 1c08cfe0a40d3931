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

#include <nlohmann/json_fwd.hpp>

#include "compute/data.hpp"
#include "compute/tokenizer.hpp"
#include "compute/grad_buffer.hpp"
#include "compute/job_config.hpp"
#include "compute/optimizer.hpp"
#include "compute/pipeline.hpp"
#include "compute/schedule.hpp"
#include "compute/collective_group.hpp"

namespace troupe {

struct step_stats {
  int step = 0;
  double loss = 0;       ///< mean loss over the global batch (the cross-entropy)
  double aux_loss = 0;   ///< experts: the load-balancing loss added to it in the backward
  expert_counts expert_tokens;  ///< experts: (token, choice) pairs per expert per layer, whole batch
  double lr = 0;
  double grad_norm = 0;  ///< global L2 norm before clipping
  double seconds = 0;
  std::int64_t tokens = 0;  ///< tokens (gpt) or images (mlp) in the step
};

/// The training data of a workload: a step's samples, independent of the layout.
class training_data {
 public:
  /// What a user of the data reads: Fashion-MNIST loads only that part (a data loader
  /// no test set, an evaluation no training set); a text corpus is read whole, once per
  /// process while any training_data holds it.
  enum class use { training, evaluation, both };
  explicit training_data(const job_config& cfg, use what = use::both);
  /// Throws data_error (naming the package) if the workload's data is not installed, or
  /// (data.text) the text is missing or too short for the model's seq_len.
  static void check_available(const job_config& cfg);
  /// What the workload's data files hold, to compare hosts (every node must read the
  /// same): "4123456 bytes, fnv1a 0123456789abcdef" over the files the workload reads, in
  /// the order it reads them. Throws data_error as reading them would.
  static std::string fingerprint(const job_config& cfg);
  /// fingerprint, and the tokenizer's (data.tokenizer): what every node must agree on.
  static std::string identity(const job_config& cfg);
  /// Samples [first, first + count) of step `step`'s global batch.
  batch samples(int step, int first, int count);
  /// gpt: the validation windows; mlp: the test set.
  batch evaluation_set() const;
  std::int64_t tokens_per_sample() const;
  /// The text it samples (null for Fashion-MNIST).
  const text_corpus* corpus() const { return text_.get(); }
  /// data.tokenizer: the token streams it samples instead of the text's bytes.
  const token_corpus* tokens() const;

 private:
  job_config cfg_;
  std::shared_ptr<const text_corpus> text_;  ///< shared by the process's users of the same corpus
  std::shared_ptr<const struct tokenized_text> tokenized_;  ///< data.tokenizer's; shared as the text is
  std::unique_ptr<fashion_mnist> images_;
  int order_epoch_ = -1;
  std::vector<std::int64_t> order_;
};

/// Loss (and, for classifiers, accuracy) of a model on an evaluation set.
struct evaluation {
  bool text = true;     ///< gpt: validation windows; mlp: test set with accuracy
  double loss = 0;
  double accuracy = 0;  ///< fraction correct (mlp only)
  double bytes_per_target = 1.0;  ///< text: the bytes a target token stands for, on average
  /// Text: the validation targets' summed cross-entropy / ln 2 / their bytes (WORKLOADS.md
  /// section 5), so that runs with different tokenizers, and bytes, compare.
  double bits_per_byte() const;
  /// Metrics fields: val_loss and val_bpb, or test_loss and test_accuracy.
  std::vector<std::pair<std::string, double>> fields() const;
  /// For the log: "validation loss 4.9058, 7.0776 bits per byte", or "test loss 0.5312,
  /// test accuracy 81.20 %".
  std::string summary() const;
};

/// One forward of an evaluation: rows [begin, begin + rows) of the evaluation set.
struct eval_forward {
  std::int64_t begin = 0, rows = 0;
};

/// The forwards an evaluation of `set` takes, in order: `tokens_per_forward` tokens each
/// (text: whole windows, at least one; images: the whole set in one).
std::vector<eval_forward> plan_evaluation(const batch& set, bool text, std::int64_t tokens_per_forward);

/// One forward's share of an evaluation: its mean loss times its rows, and (classifiers)
/// how many of its rows the model classified correctly.
struct eval_score {
  double weighted = 0, correct = 0;
};

/// Scores one forward: `output` is the last slice's forward output of the forward's rows,
/// `target` their targets (call without autograd).
eval_score score_evaluation(model_slice& last, const torch::Tensor& output, const torch::Tensor& target, bool text);

/// The evaluation of `set`'s rows from its forwards' scores, summed in forward order (one
/// forward: its loss's bits as they are: a float times a row count below 2^29 is exact in
/// double, and so is dividing it back). Logs one line naming `step` (1-based; 0: none).
evaluation combine_evaluation(const std::vector<eval_score>& scores, const batch& set, bool text, int step);

/// Evaluates `model` (no autograd) on `set` as `plan_evaluation` splits it, scoring each
/// forward and combining them as above: the actor runtime's evaluation in the pipeline
/// gives the same numbers (fp32).
evaluation evaluate_model(local_pipeline& model, const batch& set, bool text, int step,
                          std::int64_t tokens_per_forward = eval_tokens_per_forward);

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

/// A checkpoint as written by --save: FILE (model state_dict) and FILE.optim (AdamW
/// moments by parameter name and the next step).
struct checkpoint {
  state_dict model;
  std::map<std::string, torch::Tensor> params, optim;
  std::int64_t step = 0;
};
/// Reads both files and checks them against `spec` and the run's length.
checkpoint read_checkpoint(const std::string& path, const model_spec& spec, int total_steps);
/// FILE.optim's content from gathered moments (`model` gives names, order and shapes).
state_dict optimizer_state_dict(const named_moments& moments, const state_dict& model, std::int64_t next_step);

/// The metrics of `counts`: per expert layer in block order, the fewest and the most
/// (token, choice) pairs an expert got ("expert_tokens_min", "expert_tokens_max").
std::pair<std::vector<std::int64_t>, std::vector<std::int64_t>> expert_token_range(const expert_counts& counts);
/// The (token, choice) pairs of `counts` dropped past their experts' capacity, all layers.
std::int64_t expert_pairs_dropped(const expert_counts& counts);
/// A model with experts: the step's "aux_loss", "expert_tokens_min", "expert_tokens_max"
/// and, with a capacity factor, "expert_dropped" into its metrics line; without experts
/// nothing.
void add_expert_metrics(nlohmann::json& line, const step_stats& st, const model_spec& spec);

/// "1m05s" / "2h03m".
std::string duration_text(double seconds);
/// The progress line of a step: "step  3/200 | loss ... | lr ... | ... | ETA 0m12s".
std::string progress_line(const step_stats& st, int total_steps, double eta_seconds, bool tokens);

/// Exit status of a run stopped on request (SIGTERM or SIGUSR1 to the coordinator's
/// process, or to the local loop's): it finished its step, wrote a checkpoint where the
/// job has somewhere to write one, and ended. 128 + SIGTERM, as if the signal had ended
/// it; the launcher does not restart it.
constexpr int exit_stopped = 143;

/// Exit status of bad input: a configuration, data, initial weights or a checkpoint to
/// continue from that cannot be used. The launcher does not restart such a job.
constexpr int exit_bad_input = 2;
/// exit_bad_input for what reading the job's input throws (config_error, data_error,
/// checkpoint_error, model_error), else 1 (a failure).
int exit_code_of(const std::exception& e);
/// The reason of such a stop: "stopped by SIGTERM after step 7 of 200: its checkpoint is
/// in ckpt (continue with --resume ckpt)" (checkpoint_dir, else save, else nothing saved).
std::string stopped_text(int signal, int done_steps, const job_config& cfg);

/// Logs a checkpoint due after step `step` (1-based count of steps done) that could not be
/// written: the run goes on (its state is whole in memory) and tries again at the next.
void log_checkpoint_not_written(std::int64_t step, const std::string& why, int interval);

/// `troupe train`: the training loop with progress lines, metrics, evaluation and
/// checkpoints. Returns the process exit code. `stop_requested` (when given) is asked
/// after each step: a signal number ends the run there, with a checkpoint (cfg.save) and
/// exit_stopped.
/// `groups`: what tensor-parallel jobs compute over (see local_trainer).
int run_training(const job_config& cfg, const std::function<int()>& stop_requested = {},
                 const group_factory& groups = {});

}  // namespace troupe
