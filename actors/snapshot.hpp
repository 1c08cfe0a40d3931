#pragma once
// In-memory copies of the optimizer shards' state before each step, kept by the node's
// supervisor: what the actors of a step retried in place start from (the nodes rebuild
// their actors from them instead of restarting the job from a checkpoint on disk; a
// stage's parameters are all-gathered from its shards' snapshots, on whichever nodes
// they are). They live in the node's process; a shard of node i > 0 also sends each one
// to the supervisor of node i + 1 (mod N), its buddy, which keeps them in a store of its
// own: a node process that is lost and restarted takes its shards' state from there.
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "compute/optim/optimizer.hpp"
#include "messages/node_messages.hpp"

namespace troupe {

/// Shard (stage, rank)'s state before step `step`, per chunk: its range of the fp32
/// main parameters, the AdamW moments and step count. Not a copy: the tensors are the
/// shard's own double-buffered state (adamw_shard), which its next update leaves alone.
/// At the next step's begin (the step after that update is committed) the shard drops
/// the older snapshot and frees that bank (adamw_shard::release_previous): between
/// steps a shard holds one copy of its state. A
/// stage's parameters before the step are its shards' parameter ranges in rank order
/// (the all-gather's result).
struct shard_snapshot {
  std::int64_t step = 0;
  std::vector<adamw_shard::state> chunks;
  std::vector<std::int64_t> stage_numel;  ///< per chunk: elements of the stage's whole buffer
  /// Per chunk: where its expert region begins (shard_groups; stage_numel: none). The
  /// parameters before the step are the dense pieces of the data-parallel group's shards
  /// in rank order, then the expert pieces of the expert-data-parallel group's.
  std::vector<std::int64_t> stage_expert_offset;
};

class snapshot_store {
 public:
  /// Keeps the two newest snapshots of each shard (a step that fails after its shards
  /// updated still finds the one before it).
  void put(int stage, int rank, std::shared_ptr<const shard_snapshot> s) {
    std::lock_guard<std::mutex> lock(m_);
    auto& q = slots_[{stage, rank}];
    while (!q.empty() && q.back()->step >= s->step) q.pop_back();
    q.push_back(std::move(s));
    while (q.size() > 2) q.pop_front();
  }
  /// Drops shard (stage, rank)'s snapshots of steps before `step` (committed: no retry
  /// goes back to them).
  void drop_before(int stage, int rank, std::int64_t step) {
    std::lock_guard<std::mutex> lock(m_);
    auto it = slots_.find({stage, rank});
    if (it == slots_.end()) return;
    while (!it->second.empty() && it->second.front()->step < step) it->second.pop_front();
  }
  /// The state before `step`, or null.
  std::shared_ptr<const shard_snapshot> get(int stage, int rank, std::int64_t step) const {
    std::lock_guard<std::mutex> lock(m_);
    auto it = slots_.find({stage, rank});
    if (it == slots_.end()) return nullptr;
    for (const auto& s : it->second)
      if (s->step == step) return s;
    return nullptr;
  }
  /// Every shard's state before `step`, by (stage, rank).
  std::vector<std::pair<std::pair<int, int>, std::shared_ptr<const shard_snapshot>>> all_before(std::int64_t step) const {
    std::lock_guard<std::mutex> lock(m_);
    std::vector<std::pair<std::pair<int, int>, std::shared_ptr<const shard_snapshot>>> out;
    for (const auto& [key, q] : slots_)
      for (const auto& s : q)
        if (s->step == step) out.emplace_back(key, s);
    return out;
  }

 private:
  mutable std::mutex m_;
  std::map<std::pair<int, int>, std::deque<std::shared_ptr<const shard_snapshot>>> slots_;
};

/// The buddy copy of `snap` (shares its tensors until serialised).
shard_copy copy_of(int stage, int rank, const shard_snapshot& snap);
/// A snapshot holding a received copy's tensors; throws when the copy is malformed.
std::shared_ptr<const shard_snapshot> snapshot_of(const shard_copy& copy);

}  // namespace troupe
