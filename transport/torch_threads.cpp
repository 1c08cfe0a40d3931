#include "transport/torch_threads.hpp"

#include <ATen/Parallel.h>

namespace troupe::transport {

void set_intra_op_threads(int n) {
  (void)at::get_num_threads();  // (LibTorch's lazy set-up of this thread)
  at::set_num_threads(n);
}

void compute_on_one_intra_op_thread() { set_intra_op_threads(1); }

}  // namespace troupe::transport
