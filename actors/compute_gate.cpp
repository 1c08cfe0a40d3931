#include "actors/compute_gate.hpp"

#include "compute/runtime/device.hpp"

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <thread>

namespace troupe {

namespace {
std::mutex gate_mutex;
std::condition_variable gate_free;
int slots_total = 0, slots_used = 0;
}  // namespace

int compute_slots_for(const job_config& cfg, int stage_actors, int processes) {
  const bool meets_ranks = cfg.tensor_parallel > 1 || cfg.context_parallel > 1 || cfg.expert_parallel > 1 ||
                           cfg.shard != "optimizer";
  if (!resolve_device(cfg.device).is_cpu() || cfg.threads != 0 || meets_ranks) return 0;
  const int slots = std::max(1, int(std::thread::hardware_concurrency()) / std::max(1, processes));
  return slots < stage_actors ? slots : 0;
}

void set_compute_slots(int slots) {
  std::lock_guard<std::mutex> lock(gate_mutex);
  slots_total = std::max(0, slots);
  gate_free.notify_all();
}

int compute_slots() {
  std::lock_guard<std::mutex> lock(gate_mutex);
  return slots_total;
}

compute_slot::compute_slot() {
  std::unique_lock<std::mutex> lock(gate_mutex);
  if (slots_total == 0) return;
  gate_free.wait(lock, [] { return slots_total == 0 || slots_used < slots_total; });
  if (slots_total == 0) return;
  ++slots_used;
  held_ = true;
}

compute_slot::~compute_slot() {
  if (!held_) return;
  std::lock_guard<std::mutex> lock(gate_mutex);
  --slots_used;
  gate_free.notify_one();
}

}  // namespace troupe
