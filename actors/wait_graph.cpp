#include "actors/wait_graph.hpp"

#include <algorithm>
#include <functional>
#include <map>
#include <set>

#include <fmt/format.h>

namespace troupe {

bool report_other_step(wait_report& rep, std::int64_t at, std::int64_t asked) {
  if (at < asked) {
    rep.state = at < 0 ? "has run no step" : "still at step " + std::to_string(at + 1);
    rep.waits_for = "begin of step " + std::to_string(asked + 1);
    rep.from = {"coordinator"};
    rep.keys = {message_key(rep.waits_for, "coordinator", rep.actor)};
    return true;
  }
  if (at > asked) {
    rep.state = "already at step " + std::to_string(at + 1);
    return true;
  }
  return false;
}

namespace {

struct graph_node {
  const wait_report* report = nullptr;
  bool silent = false;
};

std::string node_label(const wait_report& r) {
  return r.node >= 0 ? fmt::format("{} (node {})", r.actor, r.node) : r.actor;
}

/// "A, B and C"; of more than `most`, the first `most` and how many more.
std::string joined(const std::vector<std::string>& names, std::size_t most = 100) {
  if (names.size() > most) {
    std::vector<std::string> first(names.begin(), names.begin() + std::ptrdiff_t(most));
    first.push_back(std::to_string(names.size() - most) + " more");
    return joined(first);
  }
  std::string out;
  for (std::size_t i = 0; i < names.size(); ++i)
    out += (i == 0 ? "" : i + 1 == names.size() ? " and " : ", ") + names[i];
  return out;
}

/// Why a silent actor is silent: its node's word for it (the op its thread is in, for
/// how long, or that it is in none), else that its thread is blocked.
std::string blocked_text(const wait_report& r) {
  if (r.state.empty()) return "its thread is blocked: a long op, or frozen";
  if (r.state.rfind("its thread is in op ", 0) == 0 || r.state.rfind("its thread is in the ", 0) == 0)
    return r.state + ": a long op, or frozen in it";
  return r.state;  // (a whole sentence: in no op, or its node silent too)
}

}  // namespace

wait_diagnosis diagnose_waits(const std::vector<wait_report>& given, const std::vector<wait_report>& silent,
                              double answer_seconds, bool settled) {
  // A member of a group collective waits for the members not found in the same call.
  std::vector<wait_report> reports(given);
  std::map<std::string, std::vector<std::string>> in_call;  // call -> the members in it
  for (const auto& r : reports)
    if (!r.collective.empty()) in_call[r.collective].push_back(r.actor);
  for (auto& r : reports) {
    if (r.collective.empty()) continue;
    const auto& there = in_call.at(r.collective);
    r.from.erase(std::remove_if(r.from.begin(), r.from.end(),
                                [&](const std::string& f) {
                                  return std::find(there.begin(), there.end(), f) != there.end();
                                }),
                 r.from.end());
  }
  std::map<std::string, graph_node> nodes;
  std::vector<std::string> order;  // as given: the coordinator first
  for (const auto& r : reports) {
    nodes[r.actor] = {&r, false};
    order.push_back(r.actor);
  }
  for (const auto& r : silent) {
    nodes[r.actor] = {&r, true};
    order.push_back(r.actor);
  }
  auto label = [&](const std::string& name) {
    const auto it = nodes.find(name);
    return it == nodes.end() ? name : node_label(*it->second.report);
  };
  std::set<std::string> waited_on;
  for (const auto& r : reports)
    for (const auto& f : r.from) waited_on.insert(f);

  wait_diagnosis out;
  std::map<std::string, std::size_t> line_of;  // actor -> its line in out.all_lines
  for (const auto& name : order) {
    const auto& n = nodes.at(name);
    const auto& r = *n.report;
    std::string line;
    if (n.silent) {
      line = fmt::format("{} did not answer within {:.0f} s: {}", node_label(r), answer_seconds, blocked_text(r));
    } else if (!r.waits_for.empty() && r.from.empty()) {  // a collective every member is in
      line = fmt::format("{} waits in the {}, which every member of the group has entered{}", node_label(r),
                         r.waits_for, r.state.empty() ? "" : "; " + r.state);
    } else if (!r.waits_for.empty()) {
      std::vector<std::string> from;
      for (std::size_t i = 0; i < r.from.size() && i < 8; ++i) from.push_back(label(r.from[i]));
      if (r.from.size() > 8) from.push_back(std::to_string(r.from.size() - 8) + " more");
      line = fmt::format("{} waits for {} from {}{}", node_label(r), r.waits_for, joined(from),
                         r.state.empty() ? "" : "; " + r.state);
    } else if (waited_on.count(name)) {
      line = fmt::format("{} waits for nothing{}", node_label(r), r.state.empty() ? "" : ": " + r.state);
    }
    if (line.empty()) continue;
    line_of.emplace(name, out.all_lines.size());
    out.all_lines.push_back(std::move(line));
  }
  // The chains from the coordinator to what the waiting ends at, as found below.
  std::vector<std::vector<std::string>> chains;
  auto brief = [&] {
    if (out.all_lines.size() <= brief_lines) {
      out.lines = out.all_lines;
      return;
    }
    // Many actors: the lines on the chains to the root, then the silent actors, then a count.
    std::set<std::size_t> shown;
    auto show = [&](const std::string& name) {
      const auto it = line_of.find(name);
      if (it == line_of.end() || !shown.insert(it->second).second) return;
      out.lines.push_back(out.all_lines[it->second]);
    };
    for (const auto& chain : chains)
      for (const auto& name : chain) show(name);
    auto is_shown = [&](const std::string& name) {
      const auto it = line_of.find(name);
      return it != line_of.end() && shown.count(it->second);
    };
    std::size_t more_silent = 8;
    for (const auto& r : silent)
      if (!is_shown(r.actor) && more_silent > 0) show(r.actor), --more_silent;
    const auto silent_left =
        std::count_if(silent.begin(), silent.end(), [&](const wait_report& r) { return !is_shown(r.actor); });
    if (shown.size() < out.all_lines.size())
      out.lines.push_back(fmt::format("and {} more actors wait on these or on each other, {} of them silent (every "
                                      "actor's line: the log's debug level)",
                                      out.all_lines.size() - shown.size(), silent_left));
  };

  // 1. A message its receiver waits for and its sender has sent: lost on the way.
  std::map<std::string, const std::string*> sender_of;  // message key -> the actor that sent it
  for (const auto& [name, n] : nodes)
    if (!n.silent)
      for (const auto& key : n.report->sent) sender_of.emplace(key, &name);
  std::vector<std::string> lost;
  for (const auto& r : reports) {
    if (r.keys.empty()) continue;
    const std::set<std::string> from(r.from.begin(), r.from.end());
    for (const auto& key : r.keys)
      if (const auto it = sender_of.find(key); it != sender_of.end() && from.count(*it->second)) {
        lost.push_back(key + (settled ? " was sent and never received: a lost message"
                                      : " was sent and not received yet (in flight, or lost)"));
        if (chains.size() < 3) chains.push_back({order.front(), *it->second, r.actor});
      }
  }
  if (!lost.empty()) {
    out.root = joined(lost, 3);
    brief();
    return out;
  }

  // 2. Following the waits from the first report (the coordinator's): actors that do not
  // answer, or that wait for nothing, are where the waiting ends.
  std::vector<std::string> ends, path;
  std::set<std::string> visited;
  std::vector<std::string> cycle;
  std::set<std::string> on_path;
  std::function<void(const std::string&)> visit = [&](const std::string& name) {
    if (on_path.count(name)) {
      if (cycle.empty()) {
        const auto from = std::find(path.begin(), path.end(), name);
        cycle.assign(from, path.end());
        cycle.push_back(name);
      }
      return;
    }
    if (!visited.insert(name).second) return;
    const auto it = nodes.find(name);
    if (it == nodes.end()) return;  // not asked (a supervisor): no edges known
    const auto& n = it->second;
    auto chain_ends = [&] {
      if (chains.size() >= 3) return;
      chains.push_back(path);
      chains.back().push_back(name);
    };
    if (n.silent) {
      ends.push_back(fmt::format("{} does not answer ({})", label(name), blocked_text(*n.report)));
      chain_ends();
      return;
    }
    if (!n.report->waits_for.empty() && n.report->from.empty()) {
      // Every member is in this call, and it does not finish (the same sentence for each).
      const auto& members = in_call.at(n.report->collective);
      std::vector<std::string> named;
      for (const auto& m : members) named.push_back(label(m));
      const auto text = fmt::format(
          "the {} was entered by every member ({}) and has not finished: its transport lost a transfer, or a "
          "member's device does not finish it",
          n.report->waits_for, joined(named));
      if (std::find(ends.begin(), ends.end(), text) == ends.end()) ends.push_back(text), chain_ends();
      return;
    }
    if (n.report->waits_for.empty()) {
      if (name != order.front()) {
        ends.push_back(fmt::format("{} waits for nothing{}", label(name),
                                   n.report->state.empty() ? "" : " (" + n.report->state + ")"));
        chain_ends();
      }
      return;
    }
    path.push_back(name);
    on_path.insert(name);
    for (const auto& f : n.report->from) visit(f);
    on_path.erase(name);
    path.pop_back();
  };
  if (!order.empty()) visit(order.front());
  if (!ends.empty()) {
    out.root = joined(ends, 3);
    brief();
    return out;
  }
  if (!cycle.empty()) {
    std::vector<std::string> named;
    for (const auto& c : cycle) named.push_back(label(c));
    std::string text;
    for (std::size_t i = 0; i < named.size(); ++i) text += (i ? " waits for " : "") + named[i];
    out.root = "a deadlock: " + text;
    chains.push_back(cycle);
    brief();
    return out;
  }
  out.root = "no actor waits for another (the step may have been about to finish)";
  brief();
  return out;
}

}  // namespace troupe
