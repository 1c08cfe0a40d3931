#pragma once
// A process's compute slots: at most N of its stage actors' ops compute at once. On a CPU
// with more stage actors than cores (the default job: two stages per node process, two
// node processes on two cores), each stage computing on a thread of its own has the
// kernel slice the cores between them, and every switch costs the caches; with one slot
// per core the ops take turns instead, each on a warm core, in the order they became ready.
// Only for jobs whose ops never wait for another rank inside them (no tensor, context or
// expert parallelism, no sharded parameters or gradients): an op holding a slot while it
// waits for a rank whose op waits for that slot would never finish.
#include "compute/config/job_config.hpp"

namespace troupe {

/// The slots for a job on the CPU with `stage_actors` stage actors in this process and
/// `processes` node processes on this machine: cores / processes where that is fewer
/// than the stage actors, the job's threads are automatic (train.threads = 0) and its ops
/// meet no other rank; else 0 (no limit).
int compute_slots_for(const job_config& cfg, int stage_actors, int processes);
/// Sets this process's slots (0: no limit).
void set_compute_slots(int slots);
int compute_slots();

/// Holds one slot while alive (waits for one; nothing without a limit).
class compute_slot {
 public:
  compute_slot();
  ~compute_slot();
  compute_slot(const compute_slot&) = delete;
  compute_slot& operator=(const compute_slot&) = delete;

 private:
  bool held_ = false;
};

}  // namespace troupe
