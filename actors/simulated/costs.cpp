#include <algorithm>
#include <cmath>

#include "actors/simulated/simulated.hpp"

namespace troupe {

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
  auto out = std::make_shared<simulated_costs>();
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
  l.micro_batch = c.microbatch_size();
  l.microbatches = c.microbatches;
  l.recompute = c.recompute != "none";
  l.sequence_parallel = c.sequence_parallel;
  try {
    l.schedule = parse_schedule_kind(c.schedule);
    pr.devices = l.devices();
    pr.device = plan::builtin_device(c.simulated_device);
    out->model = plan::costs_for(pr, l);
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

std::shared_ptr<sim_groups> make_sim_groups(const runtime_context& ctx) {
  auto g = std::make_shared<sim_groups>();
  for (int i = 0; i < ctx.p * ctx.t; ++i) g->by_group.push_back(std::make_shared<sim_collective>(ctx.d));
  return g;
}

}  // namespace troupe
