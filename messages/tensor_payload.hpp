#pragma once
// A tensor travelling beside a message: dtype, shape, and the data as an in-process
// hand-off (the tensor itself, no copy). Bytes never go through CAF serialisation:
// between processes a transport handle will take the place of `local` (transport/).
// An optional CRC-32 of the bytes lets the receiver detect corruption.
#include <cstdint>
#include <string>
#include <vector>

#include <caf/meta/type_name.hpp>
#include <torch/types.h>

namespace troupe {

struct tensor_payload {
  std::int8_t dtype = -1;             ///< c10::ScalarType, -1: empty
  std::vector<std::int64_t> shape;
  torch::Tensor local;                ///< in-process hand-off
  std::uint32_t checksum = 0;
  bool has_checksum = false;
};

/// Wraps `t` (contiguous; shares its storage) with an optional checksum.
tensor_payload make_payload(const torch::Tensor& t, bool with_checksum = false);

/// Checks a received payload against what the receiver expects (shape, dtype, bytes
/// present, checksum). Returns an empty string when it is fine, else the problem.
std::string check_payload(const tensor_payload& p, c10::IntArrayRef expected_shape,
                          torch::ScalarType expected_dtype);

/// The payload's tensor (no copy).
inline const torch::Tensor& tensor_of(const tensor_payload& p) { return p.local; }

std::uint32_t crc32_of(const torch::Tensor& t);

/// Metadata only: a local tensor cannot cross a process boundary.
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, tensor_payload& x) {
  return f(caf::meta::type_name("tensor_payload"), x.dtype, x.shape, x.checksum, x.has_checksum);
}

}  // namespace troupe
