#pragma once
// What a forward holds for its backward, in bytes (glibc's malloc statistics; CPU tensors).
// Shared by tests/unit/recompute_test.cpp and the runtime benchmark.
#include <malloc.h>

#include <cstdint>

#include <torch/torch.h>

#include "compute/runtime/device.hpp"
#include "compute/models/model.hpp"

namespace troupe::test {

/// Bytes malloc has handed out and not taken back: the main arena's (where the calling
/// thread allocates, when it is the process's first) and every mmapped chunk (large
/// tensors, from any thread).
inline std::int64_t malloc_bytes_in_use() {
  const auto m = mallinfo2();
  return std::int64_t(m.uordblks + m.hblkhd);
}

/// Bytes that `slice`'s forward of `input` and its loss against `target` (in `precision`)
/// hold until the backward (which then runs, so its gradients accumulate into the
/// slice's buffer). Call from the main thread, after a first forward and backward
/// (one-off buffers).
inline std::int64_t bytes_held_for_backward(model_slice& slice, const torch::Tensor& input,
                                            const torch::Tensor& target,
                                            torch::ScalarType precision = torch::kFloat32) {
  const auto before = malloc_bytes_in_use();
  torch::Tensor loss;
  {
    precision_scope amp(input.device(), precision);
    loss = slice.loss(slice.forward(input), target);
  }
  const auto held = malloc_bytes_in_use() - before;
  loss.backward();
  return held;
}

}  // namespace troupe::test
