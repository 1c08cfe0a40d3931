#pragma once
// Making and reading the tensor payloads of messages (messages/tensor_payload.hpp) on a
// device: a GPU tensor handed to another actor carries a ready event its consumer's
// stream waits on (compute/runtime/device.hpp).
#include <string>

#include <torch/types.h>

#include "messages/tensor_payload.hpp"

namespace troupe {

/// Wraps `t` (contiguous; shares its storage) with an optional checksum; a GPU tensor
/// gets a ready event on the calling thread's current stream.
tensor_payload make_payload(const torch::Tensor& t, bool with_checksum = false);

/// make_payload of `t`, or an empty payload (dtype -1) when `t` is undefined: a message's
/// optional tensor (a micro-batch's document positions).
tensor_payload optional_payload(const torch::Tensor& t);

/// Checks a received payload against what the receiver expects (shape, dtype, bytes
/// present, checksum). Returns an empty string when it is fine, else the problem.
std::string check_payload(const tensor_payload& p, c10::IntArrayRef expected_shape,
                          torch::ScalarType expected_dtype);

/// The payload's tensor (no copy); for a GPU tensor the calling thread's current stream
/// first waits for its producer's kernels.
const torch::Tensor& tensor_of(const tensor_payload& p);

}  // namespace troupe
