#include "actors/intra_op_threads.hpp"

#include "transport/torch_threads.hpp"

namespace troupe {

void one_intra_op_thread::thread_started() { transport::compute_on_one_intra_op_thread(); }

}  // namespace troupe
