#pragma once
// The safetensors format (Hugging Face's weight files), written and read here with
// nlohmann-json (no Debian package has a library for it):
//
//   8 bytes      N, the header's length, an unsigned little-endian integer
//   N bytes      a JSON object: for each tensor, {"dtype": "F32", "shape": [..],
//                "data_offsets": [begin, end]} (offsets in the data that follows), and
//                "__metadata__": {string: string} (here {"format": "pt"}); padded with
//                spaces so that the data starts at a multiple of 8
//   the data     each tensor's bytes, row-major, little-endian
#include <map>
#include <string>
#include <vector>

#include "compute/checkpoint/torch_file.hpp"  // named_tensors

namespace troupe {

/// Writes `tensors` (any supported dtype, any device) to `path` atomically, in the order
/// given, with `metadata` as the header's __metadata__.
void write_safetensors(const std::string& path, const named_tensors& tensors,
                       const std::map<std::string, std::string>& metadata = {{"format", "pt"}});

/// The tensors of a safetensors file in their order in the data, in the file's dtypes.
/// Throws std::runtime_error naming the file, and the tensor where one is at fault: a
/// truncated file, a header that does not parse, an unknown dtype, offsets that do not
/// match the shape or leave the file.
named_tensors read_safetensors(const std::string& path);

/// The same from the file's bytes (`path` names it in errors).
named_tensors read_safetensors(const std::vector<char>& bytes, const std::string& path);

/// "F32", "BF16", ... for a dtype (throws std::invalid_argument for one safetensors has not).
std::string safetensors_dtype(torch::ScalarType t);

}  // namespace troupe
