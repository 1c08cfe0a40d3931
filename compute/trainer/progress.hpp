#pragma once
// What a run tells its user: a step's numbers, the progress line, the experts' metrics,
// and the exit statuses and texts of a run that stops.
#include <cstdint>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "compute/config/job_config.hpp"
#include "compute/models/model.hpp"

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

}  // namespace troupe
