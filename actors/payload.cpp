#include "actors/payload.hpp"

#include <sstream>

#include "compute/runtime/device.hpp"

namespace troupe {

const torch::Tensor& tensor_of(const tensor_payload& p) {
  wait_ready(p.ready, p.local);
  return p.local;
}

tensor_payload make_payload(const torch::Tensor& t, bool with_checksum) {
  tensor_payload p;
  p.local = t.contiguous();
  p.dtype = static_cast<std::int8_t>(p.local.scalar_type());
  p.shape = p.local.sizes().vec();
  p.ready = record_ready(p.local);
  if (with_checksum) {
    p.checksum = crc32_of(p.local);
    p.has_checksum = true;
  }
  return p;
}

tensor_payload optional_payload(const torch::Tensor& t) { return t.defined() ? make_payload(t) : tensor_payload{}; }

std::string check_payload(const tensor_payload& p, c10::IntArrayRef expected_shape,
                          torch::ScalarType expected_dtype) {
  std::ostringstream why;
  if (!p.local.defined()) return "payload carries no tensor data";
  wait_ready(p.ready, p.local);  // a checksum reads what the producer wrote
  if (p.dtype != static_cast<std::int8_t>(expected_dtype) || p.local.scalar_type() != expected_dtype) {
    why << "dtype " << c10::toString(p.local.scalar_type()) << ", expected " << c10::toString(expected_dtype);
    return why.str();
  }
  if (p.local.sizes() != expected_shape || c10::IntArrayRef(p.shape) != expected_shape) {
    why << "shape " << p.local.sizes() << ", expected " << expected_shape;
    return why.str();
  }
  if (p.has_checksum && crc32_of(p.local) != p.checksum) return "checksum mismatch (corrupt tensor)";
  return {};
}

}  // namespace troupe
