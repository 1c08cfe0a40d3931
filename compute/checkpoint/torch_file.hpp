#pragma once
// Reading what Python's `torch.save(model.state_dict(), path)` writes, whatever the
// PyTorch version: a zip archive (torch >= 1.6) holding `data.pkl`, a pickle of the
// state_dict, and one record per tensor storage (`data/<key>`).
//
// LibTorch's own unpickler (torch::jit::pickle_load) cannot read it: it turns the
// `collections.OrderedDict` that `state_dict()` returns into None. So the pickle is read
// here, by a small pickle machine that knows only what a state_dict is made of: dicts
// (plain or ordered, with their `_metadata`), strings, numbers, tuples and lists, tensors
// rebuilt from storages (`torch._utils._rebuild_tensor_v2`, `_rebuild_parameter`), in
// any storage dtype, at any offset and stride, storages shared between tensors. Any other
// object is refused by name. The zip records are read with LibTorch's
// caffe2::serialize::PyTorchStreamReader.
#include <string>
#include <utility>
#include <vector>

#include <torch/types.h>

namespace troupe {

/// name -> tensor, in the file's order. Each tensor is contiguous and owns its memory
/// (views and shared storages are copied apart), in the dtype the file holds.
using named_tensors = std::vector<std::pair<std::string, torch::Tensor>>;

/// Reads a `torch.save` zip file's dict of tensors from its bytes. Throws
/// std::runtime_error with a message that says what is wrong (without the file's name,
/// which the caller adds).
named_tensors read_torch_state_dict(const std::vector<char>& bytes);

/// The text of the archive's record `name` (beside data.pkl, which torch.load does not
/// read), or "" when the bytes are no zip archive or it has no such record.
std::string read_torch_record(const std::vector<char>& bytes, const std::string& name);
/// The same from file `path`, reading only the archive's directory and that record ("" as
/// above, or when the file cannot be read).
std::string read_torch_file_record(const std::string& path, const std::string& name);

}  // namespace troupe
