#include "compute/trainer/progress.hpp"

#include <algorithm>
#include <cmath>
#include <csignal>
#include <tuple>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "compute/checkpoint/checkpoint.hpp"
#include "compute/data/data.hpp"

namespace troupe {

std::pair<std::vector<std::int64_t>, std::vector<std::int64_t>> expert_token_range(const expert_counts& counts) {
  std::pair<std::vector<std::int64_t>, std::vector<std::int64_t>> out;
  for (const auto& [layer, c] : counts) {
    if (c.size() < 2) continue;  // (E counts, then the pairs dropped)
    out.first.push_back(*std::min_element(c.begin(), c.end() - 1));
    out.second.push_back(*std::max_element(c.begin(), c.end() - 1));
  }
  return out;
}

std::int64_t expert_pairs_dropped(const expert_counts& counts) {
  std::int64_t dropped = 0;
  for (const auto& [layer, c] : counts)
    if (!c.empty()) dropped += c.back();
  return dropped;
}

void add_expert_metrics(nlohmann::json& line, const step_stats& st, const model_spec& spec) {
  if (spec.type != model_spec::kind::decoder || spec.decoder.n_experts == 0) return;
  line["aux_loss"] = st.aux_loss;
  std::tie(line["expert_tokens_min"], line["expert_tokens_max"]) = expert_token_range(st.expert_tokens);
  if (spec.decoder.moe_capacity_factor > 0) line["expert_dropped"] = expert_pairs_dropped(st.expert_tokens);
}

int exit_code_of(const std::exception& e) {
  const bool input = dynamic_cast<const config_error*>(&e) || dynamic_cast<const data_error*>(&e) ||
                     dynamic_cast<const checkpoint_error*>(&e) || dynamic_cast<const model_error*>(&e);
  return input ? exit_bad_input : 1;
}

std::string duration_text(double seconds) {
  const auto s = static_cast<long>(std::lround(seconds));
  char buf[32];
  if (s >= 3600)
    std::snprintf(buf, sizeof buf, "%ldh%02ldm", s / 3600, (s / 60) % 60);
  else
    std::snprintf(buf, sizeof buf, "%ldm%02lds", s / 60, s % 60);
  return buf;
}

std::string progress_line(const step_stats& st, int total_steps, double eta_seconds, bool tokens) {
  // (Experts: the load-balancing loss beside the cross-entropy, and the share of (token,
  // choice) pairs dropped past the experts' capacity where any were.)
  std::string aux = st.aux_loss != 0 ? fmt::format(" | aux_loss {:.4f}", st.aux_loss) : "";
  if (const auto dropped = expert_pairs_dropped(st.expert_tokens); dropped > 0) {
    std::int64_t pairs = 0;
    for (const auto& [layer, c] : st.expert_tokens) pairs += std::accumulate(c.begin(), c.end(), std::int64_t(0));
    aux += fmt::format(" | moe dropped {:.1f} %", 100.0 * double(dropped) / double(pairs));
  }
  char buf[256];
  std::snprintf(buf, sizeof buf, "step %*d/%d | loss %.4f%s | lr %.3e | grad_norm %.3f | %.0f %s/s | ETA %s",
                int(std::to_string(total_steps).size()), st.step + 1, total_steps, st.loss, aux.c_str(), st.lr,
                st.grad_norm, st.tokens / st.seconds, tokens ? "tok" : "img", duration_text(eta_seconds).c_str());
  return buf;
}

std::string stopped_text(int signal, int done_steps, const job_config& cfg) {
  std::string saved = "nothing saved (the job has no checkpoint_dir or save)";
  if (!cfg.checkpoint_dir.empty())
    saved = "its checkpoint is in " + cfg.checkpoint_dir + " (continue with --resume " + cfg.checkpoint_dir + ")";
  else if (!cfg.save.empty())
    saved = "its checkpoint is " + cfg.save + " (continue with --load " + cfg.save + ")";
  const std::string by = signal == SIGTERM ? "SIGTERM" : signal == SIGUSR1 ? "SIGUSR1" : "a signal";
  return "stopped by " + by + " after step " + std::to_string(done_steps) + " of " + std::to_string(cfg.steps) + ": " + saved;
}

void log_checkpoint_not_written(std::int64_t step, const std::string& why, int interval) {
  spdlog::error("step {}: checkpoint not written: {}; training goes on (the next checkpoint is due at step {})", step,
                why, step + interval);
}

}  // namespace troupe
