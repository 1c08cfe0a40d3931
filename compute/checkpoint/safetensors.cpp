#include "compute/checkpoint/safetensors.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <utility>

#include <nlohmann/json.hpp>

#include "compute/checkpoint/checkpoint.hpp"

namespace troupe {

namespace {

const std::vector<std::pair<std::string, torch::ScalarType>>& dtypes() {
  static const std::vector<std::pair<std::string, torch::ScalarType>> table{
      {"F64", torch::kFloat64}, {"F32", torch::kFloat32}, {"F16", torch::kFloat16}, {"BF16", torch::kBFloat16},
      {"I64", torch::kInt64},   {"I32", torch::kInt32},   {"I16", torch::kInt16},   {"I8", torch::kInt8},
      {"U8", torch::kUInt8},    {"BOOL", torch::kBool},
  };
  return table;
}

std::uint64_t le64(const char* p) {
  std::uint64_t v = 0;
  for (int k = 0; k < 8; ++k) v |= std::uint64_t(std::uint8_t(p[k])) << (8 * k);
  return v;
}

}  // namespace

std::string safetensors_dtype(torch::ScalarType t) {
  for (const auto& [name, type] : dtypes())
    if (type == t) return name;
  throw std::invalid_argument(std::string("safetensors has no dtype for ") + c10::toString(t));
}

void write_safetensors(const std::string& path, const named_tensors& tensors,
                       const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header;
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<torch::Tensor> data;
  std::uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    if (name == "__metadata__") throw std::invalid_argument("a tensor may not be named __metadata__");
    auto c = t.detach().to(torch::kCPU).contiguous();
    const std::uint64_t bytes = std::uint64_t(c.numel()) * c.element_size();
    header[name] = {{"dtype", safetensors_dtype(c.scalar_type())},
                    {"shape", c.sizes().vec()},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    data.push_back(std::move(c));
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
  write_file_atomically(path, [&](const byte_sink& sink) {
    char n[8];
    for (int k = 0; k < 8; ++k) n[k] = char((std::uint64_t(text.size()) >> (8 * k)) & 0xff);
    sink(n, 8);
    sink(text.data(), text.size());
    for (const auto& c : data) sink(static_cast<const char*>(c.data_ptr()), std::size_t(c.numel()) * c.element_size());
  });
}

named_tensors read_safetensors(const std::string& path) { return read_safetensors(read_file_bytes(path), path); }

named_tensors read_safetensors(const std::vector<char>& bytes, const std::string& path) {
  auto fail = [&](const std::string& what) -> void { throw std::runtime_error("safetensors file " + path + ": " + what); };
  if (bytes.size() < 8) fail("truncated: " + std::to_string(bytes.size()) + " bytes, not even the header's length");
  const std::uint64_t n = le64(bytes.data());
  if (n > bytes.size() - 8)
    fail("truncated: the header says it is " + std::to_string(n) + " bytes long; the file has " +
         std::to_string(bytes.size() - 8) + " after the length");
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(bytes.begin() + 8, bytes.begin() + 8 + std::ptrdiff_t(n));
  } catch (const nlohmann::json::exception& e) {
    fail(std::string("its header does not parse as JSON (") + e.what() + ")");
  }
  if (!header.is_object()) fail("its header is not a JSON object");
  const char* data = bytes.data() + 8 + n;
  const std::uint64_t data_size = bytes.size() - 8 - n;
  struct entry {
    std::string name;
    torch::ScalarType dtype = torch::kFloat32;
    std::vector<std::int64_t> shape;
    std::uint64_t begin = 0, end = 0;
  };
  std::vector<entry> entries;
  for (const auto& [name, info] : header.items()) {
    if (name == "__metadata__") continue;
    auto bad = [&](const std::string& what) { fail("tensor " + name + ": " + what); };
    if (!info.is_object() || !info.contains("dtype") || !info.contains("shape") || !info.contains("data_offsets"))
      bad("its entry lacks dtype, shape or data_offsets");
    entry e;
    e.name = name;
    try {
      const auto dtype = info.at("dtype").get<std::string>();
      bool known = false;
      for (const auto& [s, t] : dtypes())
        if (s == dtype) e.dtype = t, known = true;
      if (!known) bad("dtype " + dtype + " is not one Troupe reads (F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL)");
      e.shape = info.at("shape").get<std::vector<std::int64_t>>();
      const auto offsets = info.at("data_offsets").get<std::vector<std::uint64_t>>();
      if (offsets.size() != 2) bad("data_offsets is not [begin, end]");
      e.begin = offsets[0];
      e.end = offsets[1];
    } catch (const nlohmann::json::exception& ex) {
      bad(std::string("its entry does not parse (") + ex.what() + ")");
    }
    std::uint64_t numel = 1;
    for (auto d : e.shape) {
      if (d < 0) bad("a negative dimension");
      numel *= std::uint64_t(d);
    }
    const std::uint64_t need = numel * c10::elementSize(e.dtype);
    if (e.end < e.begin || e.end - e.begin != need)
      bad("data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) + ") hold " +
          std::to_string(e.end - std::min(e.begin, e.end)) + " bytes; its shape needs " + std::to_string(need));
    if (e.end > data_size)
      bad("its data ends at byte " + std::to_string(e.end) + ", past the file's " + std::to_string(data_size) +
          " bytes of data (truncated?)");
    entries.push_back(std::move(e));
  }
  std::sort(entries.begin(), entries.end(), [](const entry& a, const entry& b) { return a.begin < b.begin; });
  named_tensors out;
  for (const auto& e : entries) {
    auto t = torch::empty(e.shape, torch::TensorOptions().dtype(e.dtype));
    if (e.end > e.begin) std::memcpy(t.data_ptr(), data + e.begin, std::size_t(e.end - e.begin));
    out.emplace_back(e.name, std::move(t));
  }
  return out;
}

}  // namespace troupe
