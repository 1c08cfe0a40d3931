#include <gtest/gtest.h>
#include <torch/torch.h>

#include "launch/blas_kernels.hpp"

int main(int argc, char** argv) {
  troupe::run_with_blas_kernels(argv);  // as the troupe command does
  ::testing::InitGoogleTest(&argc, argv);
  torch::set_num_threads(2);
  return RUN_ALL_TESTS();
}
