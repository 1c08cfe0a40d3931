#include "actors/coordinator/state.hpp"

#include "compute/checkpoint/checkpoint_dir.hpp"

namespace troupe::coordinator {

void write_metrics(self_ptr self, const nlohmann::json& line) {
  auto& s = self->state;
  if (!s.metrics.is_open()) return;
  if (!s.recovery.is_null()) {
    // Set by the launcher for a restart after a failure, or for a launch that takes hosts
    // back (its stop request's time).
    const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    if (const auto& failed = s.ctx->launch.failed_at) {
      s.recovery["cause"] = "failure";
      s.recovery["seconds_from_failure_to_step"] = now - *failed;
    } else if (const auto& stopped = s.ctx->launch.regrow_at) {
      s.recovery["cause"] = "hosts back";
      s.recovery["seconds_from_stop_to_step"] = now - *stopped;
    }
    s.metrics << s.recovery.dump() << '\n';
    s.recovery = nullptr;
  }
  s.metrics << line.dump() << '\n' << std::flush;
}

void open_metrics(self_ptr self) {
  auto& s = self->state;
  const auto& cfg = s.ctx->cfg;
  if (cfg.metrics.empty()) return;
  const bool resumed = s.ctx->start_step > 0 || s.ctx->launch.attempt > 0;
  const bool continues = resumed || !cfg.resume.empty();
  // (A restarted job without a checkpoint starts at step 0 again: its old step lines go too.)
  std::int64_t last = -1;  // the last step the log had a line for
  if (continues) {
    std::ifstream in(cfg.metrics);
    std::string kept, text;
    while (std::getline(in, text)) {
      const auto j = nlohmann::json::parse(text, nullptr, false);
      const auto step = j.is_object() && j.contains("step") && j.at("step").is_number_integer() ? j.at("step").get<std::int64_t>() : -1;
      // Step lines of the steps this run does again go; events (aborts, resumes) stay.
      if (step < s.ctx->start_step || !j.is_object() || !j.contains("loss")) kept += text + "\n";
      else last = std::max(last, step);
    }
    if (in.is_open()) write_file_atomically(cfg.metrics, kept);
  }
  if (resumed) {
    s.recovery = {{"event", "resume"},
                  {"step", s.ctx->start_step},
                  {"checkpoint", cfg.resume.empty() ? cfg.load : cfg.resume},
                  {"replayed_steps", std::max<std::int64_t>(0, last + 1 - s.ctx->start_step)},
                  {"launch_attempt", s.ctx->launch.attempt}};
  }
  s.metrics.open(cfg.metrics, continues ? std::ios::app : std::ios::trunc);
  if (!s.metrics) throw std::runtime_error("cannot open metrics file " + cfg.metrics);
}

}  // namespace troupe::coordinator
