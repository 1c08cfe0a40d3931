#pragma once
// LibTorch's intra-op threads belong to the stage actors (runtime.cpp says why): every
// other thread of an actor system computes on one.
#include <caf/thread_hook.hpp>

namespace troupe {

/// A CAF thread hook (actor_system_config::add_thread_hook): each thread the scheduler
/// starts runs LibTorch's ops on one intra-op thread
/// (transport::compute_on_one_intra_op_thread). Without it such a thread took the count
/// a stage actor had set, at its first parallel LibTorch op, and started a second OpenMP
/// team (the optimizer shard's in-process reduce-scatter did; docs/performance.md,
/// llama-tiny).
class one_intra_op_thread final : public caf::thread_hook {
 public:
  void init(caf::actor_system&) override {}
  void thread_started() override;
  void thread_terminates() override {}
};

}  // namespace troupe
