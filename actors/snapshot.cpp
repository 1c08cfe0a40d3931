#include "actors/snapshot.hpp"

#include <stdexcept>
#include <string>

#include "actors/payload.hpp"

namespace troupe {

shard_copy copy_of(int stage, int rank, const shard_snapshot& snap) {
  shard_copy c;
  c.stage = stage;
  c.rank = rank;
  c.step = snap.step;
  for (const auto& ch : snap.chunks) {
    c.params.push_back(make_payload(ch.params));
    c.exp_avg.push_back(make_payload(ch.exp_avg));
    c.exp_avg_sq.push_back(make_payload(ch.exp_avg_sq));
    c.steps.push_back(ch.steps);
  }
  c.stage_numel = snap.stage_numel;
  c.stage_expert_offset = snap.stage_expert_offset;
  return c;
}

std::shared_ptr<const shard_snapshot> snapshot_of(const shard_copy& c) {
  const auto n = c.params.size();
  if (c.exp_avg.size() != n || c.exp_avg_sq.size() != n || c.steps.size() != n || c.stage_numel.size() != n ||
      c.stage_expert_offset.size() != n)
    throw std::runtime_error("malformed copy of shard[stage " + std::to_string(c.stage) + ", rank " +
                             std::to_string(c.rank) + "]");
  auto snap = std::make_shared<shard_snapshot>();
  snap->step = c.step;
  snap->stage_numel = c.stage_numel;
  snap->stage_expert_offset = c.stage_expert_offset;
  for (std::size_t i = 0; i < n; ++i) {
    const auto& p = tensor_of(c.params[i]);
    for (const auto* t : {&p, &tensor_of(c.exp_avg[i]), &tensor_of(c.exp_avg_sq[i])})
      if (!t->defined() || t->sizes() != p.sizes())
        throw std::runtime_error("copy of shard[stage " + std::to_string(c.stage) + ", rank " +
                                 std::to_string(c.rank) + "] lacks tensors or sizes differ");
    snap->chunks.push_back({p, tensor_of(c.exp_avg[i]), tensor_of(c.exp_avg_sq[i]), c.steps[i]});
  }
  return snap;
}

}  // namespace troupe
