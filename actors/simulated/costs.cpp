#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <tuple>

#include <nlohmann/json.hpp>

#include "actors/simulated/simulated.hpp"
#include "actors/supervisor_actor.hpp"
#include "compute/schedule/timed_simulation.hpp"

namespace troupe {

namespace {

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::nth_element(v.begin(), v.begin() + std::ptrdiff_t(v.size() / 2), v.end());
  return v[v.size() / 2];
}

/// The op times of a real run of this layout, from its Chrome trace (--trace): per virtual
/// stage the median forward, backward and weight op; per stage the median tail from its
/// last op to its chunks' last reduce-scatter, the optimizer's update and the all-gather.
/// Steps after the first (warm-up) where there are several.
struct trace_shape {
  schedule sched;
};

plan::layout_costs costs_from_trace(const std::string& path, const job_config& c, const trace_shape& shape) {
  std::ifstream in(path);
  if (!in) throw config_error("invalid configuration: simulated_device trace:" + path + ": cannot be read");
  nlohmann::json doc;
  try {
    in >> doc;
  } catch (const std::exception& e) {
    throw config_error("invalid configuration: simulated_device trace:" + path + ": not JSON (" + e.what() + ")");
  }
  const auto& events = doc.is_object() ? doc.at("traceEvents") : doc;
  std::int64_t last_step = 0;
  for (const auto& e : events)
    if (e.value("ph", "") == "X" && e.contains("args")) last_step = std::max<std::int64_t>(last_step, e["args"].value("step", 0));
  const std::int64_t first = last_step > 0 ? 1 : 0;
  const auto& sched = shape.sched;
  const int nv = sched.virtual_stages();
  std::vector<std::vector<double>> f(nv), b(nv), w(nv), opt(c.pipeline), ag(c.pipeline);
  // (step, replica, stage, chunk) -> last op end, last reduce-scatter end
  std::map<std::tuple<std::int64_t, int, int, int>, std::pair<double, double>> ends;
  std::size_t ops = 0;
  for (const auto& e : events) {
    if (e.value("ph", "") != "X" || !e.contains("args")) continue;
    const auto& a = e["args"];
    const auto step = a.value("step", std::int64_t(0));
    if (step < first) continue;
    const double end = e.value("ts", 0.0) + e.value("dur", 0.0), dur = e.value("dur", 0.0) * 1e-6;
    const int stage = a.value("stage", -1), replica = a.value("replica", 0), chunk = a.value("chunk", -1);
    const auto cat = e.value("cat", std::string());
    const auto name = e.value("name", std::string());
    if (cat == "compute" && stage >= 0 && stage < c.pipeline && chunk >= 0 && chunk < c.chunks) {
      const auto x = std::size_t(sched.virtual_stage(stage, chunk));
      const auto op = a.value("op", std::string());
      (op == "F" ? f : op == "B" ? b : w)[x].push_back(dur);
      auto& tail = ends[{step, replica, stage, chunk}];
      tail.first = std::max(tail.first, end);
      ++ops;
    } else if (cat == "optimizer" && stage >= 0 && stage < c.pipeline) {
      if (name == "reduce-scatter" && chunk >= 0) {
        auto& tail = ends[{step, replica, stage, chunk}];
        tail.second = std::max(tail.second, end);
      } else if (name == "optimizer") {
        opt[std::size_t(stage)].push_back(dur);
      } else if (name == "all-gather") {
        ag[std::size_t(stage)].push_back(dur);
      }
    }
  }
  if (ops == 0) throw config_error("invalid configuration: simulated_device trace:" + path + ": no ops of this layout");
  std::vector<std::vector<double>> rs(nv);
  for (const auto& [k, t] : ends)
    rs[std::size_t(sched.virtual_stage(std::get<2>(k), std::get<3>(k)))].push_back(std::max(0.0, t.second - t.first) * 1e-6);
  plan::layout_costs out;
  out.chunks.resize(std::size_t(nv));
  for (int x = 0; x < nv; ++x) {
    auto& cc = out.chunks[std::size_t(x)];
    if (f[x].empty() || b[x].empty())
      throw config_error("invalid configuration: simulated_device trace:" + path + ": no forward or backward of virtual stage " +
                         std::to_string(x) + " (a trace of another layout?)");
    cc.forward = median(f[x]);
    cc.weight = median(w[x]);
    cc.backward = median(b[x]) + cc.weight;  // (a split B is backward - weight)
    cc.reduce_scatter = cc.reduce_scatter_exposed = median(rs[x]);
    const auto [stage, chunk] = sched.place(x);
    if (chunk == 0) {  // (a stage's update and all-gather: its first chunk's)
      cc.optimizer = median(opt[std::size_t(stage)]);
      cc.all_gather = cc.all_gather_exposed = median(ag[std::size_t(stage)]);
    }
  }
  // The whole step: the schedule with these op times, then the slowest stage's tail.
  timed_costs tc;
  tc.op = [&](int stage, const pipeline_op& op) {
    return op_seconds(out.chunks[std::size_t(sched.virtual_stage(stage, op.chunk))], op);
  };
  const auto sim = simulate(sched, tc);
  double tail = 0;
  for (int k = 0; k < c.pipeline; ++k) {
    double t = 0;
    for (int ch = 0; ch < c.chunks; ++ch) {
      const auto& cc = out.chunks[std::size_t(sched.virtual_stage(k, ch))];
      t += cc.reduce_scatter_exposed + cc.optimizer + cc.all_gather_exposed;
    }
    tail = std::max(tail, t);
  }
  out.predicted.bubble = sim.bubble;
  out.predicted.parts.pipeline = sim.makespan;
  out.predicted.step_seconds = sim.makespan + tail;
  return out;
}

}  // namespace

double op_seconds(const plan::stage_costs& c, const pipeline_op& op) {
  if (op.kind == op_kind::forward) return c.forward;
  if (op.kind == op_kind::weight) return c.weight;
  return op.split ? c.backward - c.weight : c.backward;
}

std::chrono::microseconds simulated_costs::wait(double seconds) const {
  return std::chrono::microseconds(std::max<std::int64_t>(1, std::llround(seconds * scale * 1e6)));
}

std::shared_ptr<const simulated_costs> make_simulated_costs(const job_config& c, const model_spec& spec) {
  auto refuse = [](const std::string& why) {
    throw config_error("invalid configuration: compute simulated: " + why);
  };
  if (spec.type != model_spec::kind::decoder) refuse("the decoder workloads only (fmnist-mlp has no cost model)");
  if (c.schedule == "dataflow") refuse("a fixed-order schedule (dataflow's order is decided as it runs)");
  if (c.runtime != "actors") refuse("the actors runtime (it simulates the actors' ops)");
  if (!c.load.empty() || !c.resume.empty() || !c.init.empty() || !c.hf_model.empty() || !c.save.empty() ||
      !c.checkpoint_dir.empty())
    refuse("no weights are read or written (load, resume, init, train.model, save and checkpoint_dir are unset)");
  if (c.simulated_nodes > 1) job_slots(c, 0, c.simulated_nodes);  // the nodes' shares (throws where they do not fit)
  const auto faults = fault_plan::parse(c.faults());
  for (const auto& [key, nodes] : {std::make_pair("kill_node", &faults.kills), std::make_pair("freeze_node", &faults.freezes)})
    for (const auto& [node, step] : *nodes)
      if (node <= 0 || node >= c.simulated_nodes)
        refuse(std::string("faults.") + key + " names node " + std::to_string(node) + ", but " +
               (c.simulated_nodes > 1 ? "the simulated nodes that can be lost are 1 to " + std::to_string(c.simulated_nodes - 1)
                                      : std::string("the job is one node (train.simulated_nodes 1)")) +
               " (node 0, the coordinator's, is not lost)");
  auto out = std::make_shared<simulated_costs>();
  out->groups = make_sim_groups(c);
  out->device = c.simulated_device;
  out->scale = c.simulated_time_scale;
  plan::problem pr;
  pr.model = spec.decoder;
  pr.seq_len = spec.decoder.seq_len;
  pr.global_batch = c.global_batch;
  plan::layout l;
  l.tp = c.tensor_parallel;
  l.pp = c.pipeline;
  l.vp = c.chunks;
  l.dp = c.data_parallel;
  l.cp = c.context_parallel;
  l.ep = c.expert_parallel;
  l.shard = c.shard;
  l.shard_group = c.shard_group;
  l.micro_batch = c.microbatch_size();
  l.microbatches = c.microbatches;
  l.recompute = c.recompute != "none";
  l.sequence_parallel = c.sequence_parallel;
  const std::string trace_prefix = "trace:";
  try {
    l.schedule = parse_schedule_kind(c.schedule);
    if (c.simulated_device.rfind(trace_prefix, 0) == 0) {
      out->model = costs_from_trace(c.simulated_device.substr(trace_prefix.size()), c,
                                    {make_schedule(l.schedule, c.pipeline, c.microbatches, c.chunks)});
    } else {
      pr.devices = l.devices();
      pr.device = plan::builtin_device(c.simulated_device);
      out->model = plan::costs_for(pr, l);
    }
  } catch (const config_error&) {
    throw;
  } catch (const std::invalid_argument& e) {
    refuse(e.what());
  }
  double most = 0;
  for (const auto& x : out->model.chunks) most = std::max(most, x.params);
  if (c.bucket_size > 0 && c.data_parallel * c.context_parallel > 1)
    out->buckets_per_chunk = std::max<std::int64_t>(1, std::int64_t(std::ceil(most / double(c.bucket_size))));
  return out;
}

bool sim_collective::arrive(std::int64_t n, int rank, std::vector<int>& all) {
  std::lock_guard<std::mutex> lock(m_);
  auto& here = arrived_[n];
  if (std::find(here.begin(), here.end(), rank) == here.end()) here.push_back(rank);
  if (int(here.size()) < size_) return false;
  all = std::move(here);
  arrived_.erase(n);
  return true;
}

std::vector<int> sim_collective::missing(std::int64_t n) const {
  std::lock_guard<std::mutex> lock(m_);
  std::vector<int> out;
  auto it = arrived_.find(n);
  for (int r = 0; r < size_; ++r)
    if (it == arrived_.end() || std::find(it->second.begin(), it->second.end(), r) == it->second.end()) out.push_back(r);
  return out;
}

void sim_collective::forget_below(std::int64_t n) {
  std::lock_guard<std::mutex> lock(m_);
  arrived_.erase(arrived_.begin(), arrived_.lower_bound(n));
}

void sim_groups::silence(int node, bool on) {
  std::lock_guard<std::mutex> lock(silent_m_);
  if (on)
    silent_.insert(node);
  else
    silent_.erase(node);
}

bool sim_groups::silent(int node) const {
  std::lock_guard<std::mutex> lock(silent_m_);
  return silent_.count(node) > 0;
}

std::shared_ptr<sim_groups> make_sim_groups(const job_config& c) {
  auto g = std::make_shared<sim_groups>();
  for (int i = 0; i < c.pipeline * c.tensor_parallel; ++i)  // (runtime_context: p x t groups of d = DP x CP)
    g->by_group.push_back(std::make_shared<sim_collective>(c.data_parallel * c.context_parallel));
  return g;
}

}  // namespace troupe
