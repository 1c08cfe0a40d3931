#pragma once
// stage_actor: one pipeline stage of one data-parallel replica, owning its virtual chunks.
//
//        begin_step                 all ops run           all param shards in
//   idle ----------> running ops ----------------> tied/grads sent ----------------> done
//     ^              (F/B as inputs arrive)        (tied_grad, grad_shard)     (stage_done)
//     +------------------------------- reset_step ----------------------------------+
//
// An overlapped pair (combined-1f1b, dualpipev, with expert parallelism on the CPU) runs
// once both its ops' inputs are here, the forward on a thread of its own beside the
// backward. Each op runs as soon as its inputs are there: F(mb, c) needs its input (data or the
// previous virtual stage's activation) and, on the last virtual stage, its target;
// B(mb, c) needs its forward and, except on the last virtual stage, the gradient of its
// output; W(mb, c) (zero-bubble, or dataflow with split_backward: the weight gradients B
// left) needs its B. Fixed-order kinds follow the schedule's list; `dataflow` runs any
// ready op (backwards first, then forwards, then due W's one at a time while nothing
// else is ready) with at most max_in_flight micro-batches forwarded but not yet backwarded (split:
// not yet through their W). Messages of a later step are stashed and replayed; of an
// earlier one dropped.
#include <memory>

#include <caf/local_actor.hpp>

#include <vector>

#include <torch/types.h>

#include "actors/runtime.hpp"

namespace troupe {

/// Spawns the stage actor of (replica, stage), detached and monitored by `supervisor`.
/// `params` (one flat buffer per chunk; empty: the job's initial parameters) is what a
/// stage restarted in place starts from. `experts`, `experts_backward`
/// (parallel.expert_parallel > 1): the stage's expert-parallel groups, rank replica mod
/// EP, in which its expert layers' all-to-alls of forwards and of backwards run (every
/// member runs the same ops in the same order: fixed-order schedules, and evaluation
/// forwards in (forward, chunk) order). With them an overlapped pair's forward and
/// backward compute at once (on the CPU, without recomputation). `tensors`
/// (parallel.tensor_parallel > 1): the stage's tensor-parallel group, rank pipeline mod T,
/// in which its layers' collectives run (likewise in one order). `shards`
/// (parallel.shard gradients or parameters): its shards' data-parallel communicator,
/// in which its ops' reduce-scatters (and all-gathers) run (compute/optim/fsdp.hpp);
/// with expert parallelism `expert_shards`, its shards' expert-data-parallel
/// communicator, in which those of its chunks' expert regions run.
stage_actor spawn_stage_actor(caf::local_actor* supervisor, std::shared_ptr<const runtime_context> ctx,
                             std::shared_ptr<const job_wiring> wiring, int replica, int stage,
                             std::vector<torch::Tensor> params = {},
                             std::shared_ptr<transport::communicator> experts = nullptr,
                             std::shared_ptr<transport::communicator> experts_backward = nullptr,
                             std::shared_ptr<transport::communicator> tensors = nullptr,
                             std::shared_ptr<transport::communicator> contexts = nullptr,
                             std::shared_ptr<transport::communicator> shards = nullptr,
                             std::shared_ptr<transport::communicator> expert_shards = nullptr);

}  // namespace troupe
