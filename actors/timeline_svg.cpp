#include "actors/timeline_svg.hpp"

#include <algorithm>
#include <cstdio>
#include <map>
#include <sstream>
#include <stdexcept>

#include <nlohmann/json.hpp>

namespace troupe {

timeline timeline_of(const schedule& s, const op_costs& costs) {
  const auto sim = simulate(s, costs);
  auto compute = [&](const pipeline_op& op) { return compute_cost(s, costs, op); };
  std::ostringstream title;
  title << to_string(s.kind) << ": " << s.stages << " stages x " << s.microbatches << " micro-batches"
        << (s.chunks > 1 ? " x " + std::to_string(s.chunks) + " chunks" : "") << " (simulated, makespan "
        << sim.makespan << ")";
  timeline t;
  t.title = title.str();
  t.rows = s.stages;
  t.chunks = s.chunks > 1;
  t.unit = "op costs";
  for (int r = 0; r < s.stages; ++r) {
    const auto& ops = s.ranks[r];
    for (std::size_t i = 0; i < ops.size(); ++i) {
      const auto& op = ops[i];
      auto [start, end] = sim.times[r][i];
      const bool first_of_pair = op.paired && i + 1 < ops.size();
      const bool second_of_pair = i > 0 && ops[i - 1].paired;
      if (first_of_pair || second_of_pair) {  // split the pair's interval by compute cost
        const auto& a = first_of_pair ? op : ops[i - 1];
        const auto& b = first_of_pair ? ops[i + 1] : op;
        const double total = compute(a) + compute(b);
        const double mid = start + (end - start) * (total > 0 ? compute(a) / total : 0.5);
        (first_of_pair ? end : start) = mid;
      }
      const bool a2a = costs.alltoall > 0 && op.kind != op_kind::weight;
      t.blocks.push_back({r, op.kind, op.mb, op.chunk, start, end, first_of_pair || second_of_pair,
                          a2a ? std::min(costs.alltoall, end - start) : 0.0});
    }
  }
  return t;
}

timeline timeline_of_trace(const std::string& trace_json, long long step, int replica) {
  using nlohmann::json;
  json doc;
  try {
    doc = json::parse(trace_json);
  } catch (const json::exception& e) {
    throw std::runtime_error(std::string("not a Chrome trace (JSON): ") + e.what());
  }
  const json& events = doc.is_object() && doc.contains("traceEvents") ? doc["traceEvents"] : doc;
  if (!events.is_array()) throw std::runtime_error("not a Chrome trace: no traceEvents array");
  struct ev {
    long long step;
    int stage, mb, chunk;
    std::string op;
    double ts, dur;
  };
  std::vector<ev> compute;
  long long last_step = -1;
  for (const auto& e : events) {
    if (!e.is_object() || e.value("cat", "") != "compute" || e.value("pid", -1) != replica) continue;
    const auto& a = e.value("args", json::object());
    ev x{a.value("step", -1LL), e.value("tid", 0), a.value("mb", 0), a.value("chunk", 0), a.value("op", ""),
         e.value("ts", 0.0), e.value("dur", 0.0)};
    last_step = std::max(last_step, x.step);
    compute.push_back(std::move(x));
  }
  if (compute.empty())
    throw std::runtime_error("the trace has no compute events of replica " + std::to_string(replica) +
                             " (written with trace = true by the actor runtime?)");
  if (step < 0) step = last_step;
  timeline t;
  t.unit = "ms";
  double t0 = 0;
  bool any = false;
  for (const auto& x : compute) {
    if (x.step != step) continue;
    t0 = any ? std::min(t0, x.ts) : x.ts;
    any = true;
  }
  if (!any) throw std::runtime_error("the trace has no compute events of step " + std::to_string(step));
  for (const auto& x : compute) {
    if (x.step != step) continue;
    const op_kind k = x.op == "F" ? op_kind::forward : x.op == "B" ? op_kind::backward : op_kind::weight;
    t.rows = std::max(t.rows, x.stage + 1);
    t.chunks = t.chunks || x.chunk > 0;
    t.blocks.push_back({x.stage, k, x.mb, x.chunk, (x.ts - t0) * 1e-3, (x.ts + x.dur - t0) * 1e-3});
  }
  t.title = "trace: step " + std::to_string(step) + ", replica " + std::to_string(replica) + ", " +
            std::to_string(t.rows) + " stages (measured)";
  return t;
}

namespace {

// Fill colours by kind, darker for chunk 1 and up (the papers' convention).
const char* fill(op_kind k, int chunk) {
  static const char* f[2] = {"#8ec5ff", "#3d8bd9"};
  static const char* b[2] = {"#9be29b", "#3fae4f"};
  static const char* w[2] = {"#d9b3ff", "#9c5fd6"};
  const int c = chunk > 0 ? 1 : 0;
  return k == op_kind::forward ? f[c] : k == op_kind::backward ? b[c] : w[c];
}

std::string num(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", x);
  return buf;
}

std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) out += c == '<' ? "&lt;" : c == '>' ? "&gt;" : c == '&' ? "&amp;" : std::string(1, c);
  return out;
}

}  // namespace

std::string to_svg(const timeline& t) {
  double makespan = 0;
  for (const auto& b : t.blocks) makespan = std::max(makespan, b.end);
  const double label_w = 70, width = 1200, row_h = 28, a2a_h = 5, top = 34;
  const double scale = makespan > 0 ? (width - label_w - 10) / makespan : 1;
  const double height = top + t.rows * (row_h + a2a_h + 6) + 30;
  std::ostringstream o;
  o << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width << "\" height=\"" << num(height)
    << "\" font-family=\"sans-serif\" font-size=\"11\">\n";
  o << "<title>" << escape(t.title) << "</title>\n";
  o << "<text x=\"4\" y=\"16\" font-size=\"13\">" << escape(t.title) << "</text>\n";
  for (int r = 0; r < t.rows; ++r) {
    const double y = top + r * (row_h + a2a_h + 6);
    o << "<text x=\"4\" y=\"" << num(y + row_h * 0.65) << "\">stage " << r << "</text>\n";
  }
  for (const auto& b : t.blocks) {
    const double y = top + b.row * (row_h + a2a_h + 6);
    const double x = label_w + b.start * scale, w = std::max(0.5, (b.end - b.start) * scale);
    const std::string op = std::string(op_letter(b.kind)) + std::to_string(b.mb) +
                           (t.chunks ? "." + std::to_string(b.chunk) : "");
    o << "<rect class=\"op\" data-row=\"" << b.row << "\" data-op=\"" << op << "\" x=\"" << num(x) << "\" y=\""
      << num(y) << "\" width=\"" << num(w) << "\" height=\"" << row_h << "\" fill=\"" << fill(b.kind, b.chunk)
      << "\" stroke=\"" << (b.paired ? "#000" : "#fff") << "\" stroke-width=\"" << (b.paired ? 2 : 1)
      << "\"><title>" << op << " [" << num(b.start) << ", " << num(b.end) << "] " << t.unit << "</title></rect>\n";
    if (w >= 10)
      o << "<text x=\"" << num(x + w / 2) << "\" y=\"" << num(y + row_h * 0.65) << "\" text-anchor=\"middle\">"
        << b.mb << "</text>\n";
    if (b.alltoall > 0)
      o << "<rect class=\"alltoall\" data-row=\"" << b.row << "\" x=\"" << num(x) << "\" y=\"" << num(y + row_h + 1)
        << "\" width=\"" << num(std::max(0.5, b.alltoall * scale)) << "\" height=\"" << a2a_h
        << "\" fill=\"#f0a030\"><title>all-to-all of " << op << "</title></rect>\n";
  }
  const double y = top + t.rows * (row_h + a2a_h + 6) + 16;
  o << "<text x=\"" << label_w << "\" y=\"" << num(y) << "\">0</text><text x=\"" << num(width - 10) << "\" y=\""
    << num(y) << "\" text-anchor=\"end\">" << num(makespan) << " " << escape(t.unit) << "</text>\n";
  o << "<text x=\"" << num(width / 2) << "\" y=\"" << num(y)
    << "\" text-anchor=\"middle\">F light blue, B green, W purple (darker: chunk 1+), F&amp;B pairs framed black, "
       "all-to-all orange</text>\n";
  o << "</svg>\n";
  return o.str();
}

}  // namespace troupe
