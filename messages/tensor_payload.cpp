#include "messages/tensor_payload.hpp"

#include <zlib.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>

namespace troupe {

namespace {
/// `t` in host memory (GPU tensors are copied: checksums and serialisation read bytes).
torch::Tensor on_host(const torch::Tensor& t) { return t.device().is_cpu() ? t.contiguous() : t.to(torch::kCPU).contiguous(); }
}  // namespace

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

}  // namespace troupe
