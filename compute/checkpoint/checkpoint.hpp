#pragma once
// Checkpoints in PyTorch's own format: `torch.load(path)` in Python returns a dict of
// GPT-2-named tensors. Writes are atomic: temp file, fsync, rename, fsync of the folder.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "compute/models/model.hpp"
#include "compute/runtime/file_bytes.hpp"

namespace troupe {

/// One file of a step folder, as its manifest lists it.
struct checkpoint_file {
  std::string name;  ///< in the step folder: "stage-K.pt", "optim-stage-K.pt"
  int stage = 0;
  std::string kind;  ///< "parameters" or "optimizer"
  std::uint64_t bytes = 0;
  std::uint32_t crc32 = 0;
};

/// Writes `state` as a PyTorch-readable `state_dict` file, atomically.
void save_state_dict(const std::string& path, const state_dict& state);

/// The bytes save_state_dict writes (torch.save's zip format), to `sink` as they are
/// made: no copy of the whole file is held in memory. `records` (name, text) go into the
/// archive beside data.pkl: torch.load reads only what data.pkl refers to.
void write_state_dict(const state_dict& state, const byte_sink& sink,
                      const std::vector<std::pair<std::string, std::string>>& records = {});

/// What marks the two files of one `--save` (FILE and FILE.optim) as one pair: the step
/// they continue with and an id drawn for that save, in an archive record of each file.
struct pair_mark {
  std::int64_t step = -1;  ///< -1: the file has no mark (not written by Troupe's --save)
  std::string id;
  bool operator==(const pair_mark& o) const { return step == o.step && id == o.id; }
};

/// save_state_dict_pair's failure after FILE.optim was replaced but FILE was not (its
/// rename failed): the two files on disk are of different saves, which read_checkpoint
/// refuses.
struct mixed_pair_error : checkpoint_error {
  using checkpoint_error::checkpoint_error;
};

/// Writes the --save pair: `model` to `path` and `optim` to `path`.optim, both marked with
/// `step` and one new id; `model_record` (TOML text of the model: saved_model_toml), if
/// any, goes into `path`'s archive record "troupe_model.toml" (torch.load passes it over). Both are written in full (and synced) under temporary names
/// before either is renamed into place: a crash leaves the old pair, or the new one, or
/// (between the two renames) a pair whose marks differ, which read_checkpoint refuses.
/// Throws checkpoint_error (a failed write: both files as they were), or mixed_pair_error.
void save_state_dict_pair(const std::string& path, const state_dict& model, const state_dict& optim,
                          std::int64_t step, const std::string& model_record = "");

/// The archive record of a --save file's model ("troupe_model.toml").
inline constexpr const char* model_record_name = "troupe_model.toml";

/// The mark of a file's bytes (step -1 when it has none).
pair_mark read_pair_mark(const std::vector<char>& bytes);

/// Reads a `state_dict` written by `save_state_dict` or by Python's `torch.save` of a
/// dict / OrderedDict of tensors. Throws checkpoint_error naming the file on any problem.
state_dict load_state_dict(const std::string& path);

/// The same from a file's bytes already in memory (`path` names it in errors).
state_dict load_state_dict(const std::vector<char>& bytes, const std::string& path);


}  // namespace troupe
