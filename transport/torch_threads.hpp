#pragma once
// LibTorch's intra-op threads belong to the threads that compute: a thread that only
// moves data (the transport's, an actor system's scheduler) runs LibTorch ops on one.

namespace troupe::transport {

/// Sets the calling thread's LibTorch intra-op thread count for good. LibTorch sets a
/// thread's count once, lazily, at its first parallel op, from the process-wide value
/// (the last set_num_threads of any thread): that set-up runs first here, so that it
/// cannot undo `n` later.
void set_intra_op_threads(int n);

/// set_intra_op_threads(1). libgomp gives every thread that starts a parallel region a
/// team of its own, and once there are more OpenMP threads than cores it stops
/// spin-waiting between regions: every small op of the computing threads then pays a
/// futex wake-up.
void compute_on_one_intra_op_thread();

}  // namespace troupe::transport
