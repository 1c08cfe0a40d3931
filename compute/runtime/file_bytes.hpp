#pragma once
// Whole files in and out: a file's bytes read in one allocation, and atomic writes
// (a temporary file in the same folder, fsync, rename, fsync of the folder).
#include <cstddef>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace troupe {

/// A file (a checkpoint, a tokenizer's model, initial weights) that cannot be read or
/// written; its text names the file.
struct checkpoint_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// Takes a file's bytes, piece by piece.
using byte_sink = std::function<void(const char* data, std::size_t n)>;

/// A whole file's bytes, read in one allocation of its size. Throws checkpoint_error.
std::vector<char> read_file_bytes(const std::string& path);

/// Writes `bytes` to `path` atomically (temp file in the same folder, fsync, rename).
void write_file_atomically(const std::string& path, const std::string& bytes);

/// The same with the bytes that `produce` gives its sink. Throws checkpoint_error (a
/// failed write: the file as it was, no temporary file left).
void write_file_atomically(const std::string& path, const std::function<void(const byte_sink&)>& produce);

/// `produce`'s bytes in a new temporary file beside `path`, synced; returns its name.
/// Throws checkpoint_error (no temporary file left).
std::string write_temporary(const std::string& path, const std::function<void(const byte_sink&)>& produce);
/// Renames the temporary file `tmp` to `path` (removing `tmp` if that fails). Throws
/// checkpoint_error.
void rename_into_place(const std::string& tmp, const std::string& path);
/// Makes the renames in `path`'s folder durable.
void sync_folder_of(const std::string& path);

}  // namespace troupe
