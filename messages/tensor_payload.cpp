#include "messages/tensor_payload.hpp"

#include <zlib.h>

#include <cstring>
#include <sstream>

namespace troupe {

namespace {
/// `t` in host memory (GPU tensors are copied: checksums and serialisation read bytes).
torch::Tensor on_host(const torch::Tensor& t) { return t.device().is_cpu() ? t.contiguous() : t.to(torch::kCPU).contiguous(); }
}  // namespace

const torch::Tensor& tensor_of(const tensor_payload& p) {
  wait_ready(p.ready, p.local);
  return p.local;
}

std::uint32_t crc32_of(const torch::Tensor& t) {
  auto c = on_host(t);
  const auto* bytes = static_cast<const Bytef*>(c.data_ptr());
  std::size_t n = c.numel() * c.element_size();
  uLong crc = crc32(0L, Z_NULL, 0);
  while (n > 0) {
    const auto chunk = static_cast<uInt>(std::min<std::size_t>(n, 1u << 30));
    crc = crc32(crc, bytes, chunk);
    bytes += chunk;
    n -= chunk;
  }
  return static_cast<std::uint32_t>(crc);
}

std::int64_t payload_bytes(const tensor_payload& p) {
  if (p.dtype < 0) return 0;
  std::int64_t n = std::int64_t(c10::elementSize(static_cast<c10::ScalarType>(p.dtype)));
  for (auto d : p.shape) n *= d;
  return n;
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

std::vector<char> bytes_of(const torch::Tensor& t) {
  auto c = on_host(t);
  const auto* p = static_cast<const char*>(c.data_ptr());
  return std::vector<char>(p, p + c.numel() * c.element_size());
}

torch::Tensor tensor_from_bytes(const std::vector<char>& bytes, std::int8_t dtype, const std::vector<std::int64_t>& shape) {
  auto t = torch::empty(shape, torch::TensorOptions().dtype(static_cast<torch::ScalarType>(dtype)));
  if (std::size_t(t.numel() * t.element_size()) != bytes.size())
    throw std::runtime_error("tensor payload: " + std::to_string(bytes.size()) + " bytes for shape of " +
                             std::to_string(t.numel()) + " elements");
  std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  return t;
}

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
