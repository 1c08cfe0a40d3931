#pragma once
// LibTorch's intra-op threads belong to the stage actors: a thread of anything else (the
// transport's, an actor system's scheduler) runs LibTorch ops on one.

namespace troupe::transport {

/// Makes the calling thread run LibTorch's ops on one intra-op thread for good. libgomp
/// gives every thread that starts a parallel region a team of its own, and once there are
/// more OpenMP threads than cores it stops spin-waiting between regions: every small op
/// of a stage then pays a futex wake-up. LibTorch sets a thread's count once, lazily, at
/// its first parallel op, from the process-wide value (the last set_num_threads, which a
/// stage actor may have raised): this runs that set-up first, then sets 1.
void compute_on_one_intra_op_thread();

}  // namespace troupe::transport
