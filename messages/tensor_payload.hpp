#pragma once
// A tensor travelling beside a message: dtype, shape, and either the data as an
// in-process hand-off (the tensor itself, no copy) or a transport handle (the sending node
// and a tag: the bytes travel over UCX, never through CAF). Payloads without a handle
// that do cross processes (the coordinator's state gathers for checkpoints, the
// evaluation's inputs and targets, a loader's targets) have their bytes written by CAF's
// serializer after the metadata.
// An optional CRC-32 of the bytes lets the receiver detect corruption.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <caf/deserializer.hpp>
#include <caf/meta/load_callback.hpp>
#include <caf/meta/type_name.hpp>
#include <caf/serializer.hpp>
#include <torch/types.h>

namespace troupe {

struct tensor_payload {
  std::int8_t dtype = -1;             ///< c10::ScalarType, -1: empty
  std::vector<std::int64_t> shape;
  torch::Tensor local;                ///< in-process hand-off
  std::uint32_t checksum = 0;
  bool has_checksum = false;
  /// Transport handle: the bytes come separately over the job's world communicator
  /// from rank (node) `src_node`, tagged `tag` (-1: no handle).
  std::int32_t src_node = -1;
  std::uint32_t tag = 0;
  /// In-process hand-off of a GPU tensor: the event its producer recorded after the
  /// kernels that write it (compute/runtime/device.hpp's ready_event; the consumer's stream waits
  /// on it; never serialised). actors/payload.hpp makes and reads payloads with it.
  std::shared_ptr<void> ready;
};

std::uint32_t crc32_of(const torch::Tensor& t);

/// The tensor's size in bytes, from the payload's dtype and shape (0 when empty).
std::int64_t payload_bytes(const tensor_payload& p);

/// The bytes of `t` (serialisation between nodes).
std::vector<char> bytes_of(const torch::Tensor& t);
/// A tensor of `dtype` and `shape` from `bytes`; throws if the sizes disagree.
torch::Tensor tensor_from_bytes(const std::vector<char>& bytes, std::int8_t dtype, const std::vector<std::int64_t>& shape);

/// Metadata, and the bytes only for CAF's (de)serializer (between nodes); printing a
/// message never shows tensor bytes.
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, tensor_payload& x) {
  constexpr bool wire = std::is_base_of<caf::serializer, Inspector>::value ||
                        std::is_base_of<caf::deserializer, Inspector>::value;
  if constexpr (!wire) {
    return f(caf::meta::type_name("tensor_payload"), x.dtype, x.shape, x.checksum, x.has_checksum, x.src_node, x.tag);
  } else {
    std::vector<char> bytes;
    if constexpr (Inspector::reads_state)
      if (x.local.defined()) bytes = bytes_of(x.local);
    auto load = caf::meta::load_callback([&]() -> caf::error {
      if (!bytes.empty()) x.local = tensor_from_bytes(bytes, x.dtype, x.shape);
      return caf::none;
    });
    return f(caf::meta::type_name("tensor_payload"), x.dtype, x.shape, x.checksum, x.has_checksum, x.src_node, x.tag,
             bytes, load);
  }
}

}  // namespace troupe
