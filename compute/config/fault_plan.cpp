#include "compute/config/fault_plan.hpp"

#include <cmath>
#include <sstream>
#include <vector>

#include "compute/config/config_error.hpp"

namespace troupe {

namespace {

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, sep)) out.push_back(item);
  if (!s.empty() && s.back() == sep) out.emplace_back();
  return out;
}

/// A non-negative integer, all of `s`; nullopt otherwise.
std::optional<std::int64_t> count(const std::string& s) {
  if (s.empty() || s.size() > 12) return std::nullopt;
  for (char c : s)
    if (c < '0' || c > '9') return std::nullopt;
  return std::stoll(s);
}

/// A positive (or, with `zero`, a nonnegative) number of seconds, all of `s`; nullopt otherwise.
std::optional<double> seconds(const std::string& s, bool zero = false) {
  try {
    std::size_t used = 0;
    const double x = std::stod(s, &used);
    if (used == s.size() && std::isfinite(x) && (x > 0 || (zero && x == 0)) && x <= 3600) return x;
  } catch (...) {
  }
  return std::nullopt;
}

/// The first three fields as counts.
bool three_counts(const std::vector<std::string>& f, std::int64_t& a, std::int64_t& b, std::int64_t& c) {
  if (f.size() < 3) return false;
  const auto x = count(f[0]), y = count(f[1]), z = count(f[2]);
  if (!x || !y || !z) return false;
  a = *x, b = *y, c = *z;
  return true;
}

}  // namespace

const char* name(message_action a) {
  switch (a) {
    case message_action::drop: return "drop";
    case message_action::duplicate: return "duplicate";
    case message_action::corrupt: return "corrupt";
    case message_action::delay: return "delay";
  }
  return "?";
}

bool fault_plan::empty() const {
  return !stage_throw && !message && !stall && !freeze && kills.empty() && freezes.empty() && !write_kill &&
         nan_at < 0;
}

fault_plan fault_plan::parse(const fault_keys& cfg) {
  fault_plan plan;
  plan.attempt = cfg.fault_attempt;
  plan.nan_at = cfg.nan_at;
  // node:step[+node:step...], a node once.
  const auto node_steps = [](const std::string& text, const char* key) {
    std::map<int, std::int64_t> out;
    if (text.empty()) return out;
    const auto usage =
        std::string(key) + " must be node:step or several joined by '+' (one per node), not '" + text + "'";
    for (const auto& item : split(text, '+')) {
      const auto f = split(item, ':');
      const auto node = f.size() == 2 ? count(f[0]) : std::nullopt;
      const auto step = f.size() == 2 ? count(f[1]) : std::nullopt;
      if (!node || !step || !out.emplace(int(*node), *step).second) throw config_error(usage);
    }
    return out;
  };
  plan.kills = node_steps(cfg.kill_node, "faults.kill_node");
  plan.freezes = node_steps(cfg.freeze_node, "faults.freeze_node");

  if (!cfg.throw_at.empty()) {
    const auto f = split(cfg.throw_at, ':');
    std::int64_t r = 0, k = 0, s = 0;
    const bool when_ok = f.size() == 3 || (f.size() == 4 && (f[3] == "late" || f[3] == "eval"));
    if (!three_counts(f, r, k, s) || !when_ok)
      throw config_error("faults.throw_at must be replica:stage:step[:late|:eval], not '" + cfg.throw_at + "'");
    plan.stage_throw = stage_throw_fault{int(r), int(k), s,
                                         f.size() == 3      ? throw_point::in_step
                                         : f[3] == "late"   ? throw_point::after_update
                                                            : throw_point::in_evaluation};
  }

  if (!cfg.message.empty()) {
    const auto usage = "faults.message must be drop|duplicate|corrupt|delay[=SECONDS]@replica:stage:step[:loss|:eval], not '" +
                       cfg.message + "'";
    const auto at = cfg.message.find('@');
    if (at == std::string::npos) throw config_error(usage);
    auto action = cfg.message.substr(0, at);
    message_fault m;
    if (const auto eq = action.find('='); eq != std::string::npos) {
      const auto d = seconds(action.substr(eq + 1));
      if (!d || action.substr(0, eq) != "delay") throw config_error(usage);
      m.delay_seconds = *d;
      action = action.substr(0, eq);
    }
    if (action == "drop") m.action = message_action::drop;
    else if (action == "duplicate") m.action = message_action::duplicate;
    else if (action == "corrupt") m.action = message_action::corrupt;
    else if (action == "delay") m.action = message_action::delay;
    else throw config_error(usage);
    const auto f = split(cfg.message.substr(at + 1), ':');
    std::int64_t r = 0, k = 0, s = 0;
    const bool target_ok = f.size() == 3 || (f.size() == 4 && (f[3] == "loss" || f[3] == "eval"));
    if (!three_counts(f, r, k, s) || !target_ok) throw config_error(usage);
    m.replica = int(r), m.stage = int(k), m.step = s;
    m.target = f.size() == 3 ? message_target::tensor
               : f[3] == "loss" ? message_target::loss_report
                                : message_target::eval_result;
    if (m.target != message_target::tensor) {
      const std::string report = m.target == message_target::loss_report ? "loss report" : "evaluation result";
      if (m.action == message_action::corrupt)
        throw config_error("faults.message: a " + report + " carries no checksum to corrupt (" + cfg.message + ")");
      if (m.stage != cfg.pipeline - 1)
        throw config_error("faults.message: " + report + "s come from the last stage (" +
                           std::to_string(cfg.pipeline - 1) + "), not " + std::to_string(m.stage));
    }
    plan.message = m;
  }

  if (!cfg.stall.empty()) {
    const auto f = split(cfg.stall, ':');
    std::int64_t k = 0, r = 0, s = 0;
    if (f.size() != 3 || !three_counts(f, k, r, s))
      throw config_error("faults.stall must be stage:rank:step, not '" + cfg.stall + "'");
    plan.stall = stall_fault{int(k), int(r), s};
  }

  if (!cfg.freeze.empty()) {
    const auto f = split(cfg.freeze, ':');
    std::int64_t r = 0, k = 0, s = 0;
    std::optional<double> d = 15.0;
    if (f.size() == 4) d = seconds(f[3]);
    if ((f.size() != 3 && f.size() != 4) || !three_counts(f, r, k, s) || !d)
      throw config_error("faults.freeze must be replica:stage:step[:SECONDS], not '" + cfg.freeze + "'");
    plan.freeze = freeze_fault{int(r), int(k), s, *d};
  }

  if (!cfg.kill_in_write.empty()) {
    const auto f = split(cfg.kill_in_write, ':');
    const auto node = f.size() >= 2 ? count(f[0]) : std::nullopt;
    const auto step = f.size() >= 2 ? count(f[1]) : std::nullopt;
    const auto d = f.size() == 3 ? seconds(f[2], /*zero=*/true) : std::optional<double>(0.0);  // 0: at once
    if ((f.size() != 2 && f.size() != 3) || !node || !step || !d)
      throw config_error("faults.kill_in_write must be node:step[:SECONDS], not '" + cfg.kill_in_write + "'");
    plan.write_kill = write_kill_fault{int(*node), *step, *d};
  }
  return plan;
}

bool fault_injector::stage_throws(int replica, int stage, std::int64_t step, std::int32_t attempt,
                                  throw_point at) const {
  const auto& t = plan_.stage_throw;
  return t && attempt == 0 && t->replica == replica && t->stage == stage && t->step == step && t->when == at;
}

std::optional<message_fault> fault_injector::take_message(int replica, int stage, std::int64_t step,
                                                          std::int32_t attempt, message_target target) {
  const auto& m = plan_.message;
  if (!m || message_fired_ || attempt != 0 || m->replica != replica || m->stage != stage || m->step != step ||
      m->target != target)
    return std::nullopt;
  message_fired_ = true;
  return m;
}

std::optional<double> fault_injector::take_freeze(int replica, int stage, std::int64_t step, std::int32_t attempt) {
  const auto& f = plan_.freeze;
  if (!f || freeze_fired_ || attempt != 0 || f->replica != replica || f->stage != stage || f->step != step)
    return std::nullopt;
  freeze_fired_ = true;
  return f->seconds;
}

bool fault_injector::shard_stalls(int stage, int rank, std::int64_t step, std::int32_t attempt) const {
  const auto& s = plan_.stall;
  return s && attempt == 0 && s->stage == stage && s->rank == rank && s->step == step;
}

bool fault_injector::kills_node(int node, std::int64_t step, std::int32_t attempt) const {
  const auto it = plan_.kills.find(node);
  return attempt == 0 && it != plan_.kills.end() && it->second == step;
}

bool fault_injector::freezes_node(int node, std::int64_t step, std::int32_t attempt) const {
  const auto it = plan_.freezes.find(node);
  return attempt == 0 && it != plan_.freezes.end() && it->second == step;
}

std::optional<double> fault_injector::write_kill(int node, std::int64_t step) const {
  const auto& k = plan_.write_kill;
  if (!k || k->node != node || k->step != step) return std::nullopt;
  return k->seconds;
}

bool fault_injector::nan_loss(std::int64_t step, std::int32_t attempt) const {
  return attempt == 0 && plan_.nan_at == step;
}

}  // namespace troupe
