#pragma once
// Documents (WORKLOADS.md section 6): JSON lines, files, folders of files and Megatron's
// indexed datasets, as one token stream. Each document's ids are its tokenizer's (the
// model folder's, as AutoTokenizer encodes), EOS appended unless already last; a Megatron
// dataset's ids are taken as stored.
//
// Text documents are encoded once, streaming and on every core, into the token cache
// (`<cache dir>/docs-<fingerprint>.bin`, an atomic rename); a Megatron dataset's .bin is
// memory-mapped as it is, its sizes read from the .idx alone.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "compute/data/tokenizer.hpp"

namespace troupe {

/// How a data path is read.
enum class data_format { json_lines, megatron, file, folder };
/// `path`'s format: a `.jsonl` file, a prefix whose .bin and .idx exist, a folder, any
/// other file. Throws data_error when it is none of them.
data_format data_format_of(const std::string& path);
const char* data_format_name(data_format f);

/// A Megatron indexed dataset's .idx (MMIDIDX version 1), checked against its .bin.
struct megatron_index {
  int dtype_code = 0;  ///< 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 8 uint16
  int width = 0;
  bool is_signed = false;
  std::vector<std::int32_t> sequence_lengths;
  std::vector<std::int64_t> sequence_pointers, document_indices;
  std::uint64_t tokens = 0;  ///< all sequences' lengths
};
/// Reads `prefix`.idx; throws data_error naming the file for a bad header, an unknown or
/// floating-point dtype, sizes that disagree with `prefix`.bin, or sequences that are not
/// stored in order.
megatron_index read_megatron_index(const std::string& prefix);

/// Writes a Megatron indexed dataset as Megatron-Core's IndexedDatasetBuilder does (one
/// sequence per document), into temporary files renamed at finish().
class megatron_writer {
 public:
  /// uint16 ids for a vocabulary under 65500 ids, else int32 (Megatron's optimal_dtype).
  megatron_writer(const std::string& prefix, int vocab_size);
  ~megatron_writer();
  void add_document(const std::vector<int>& ids);
  void finish();
  int dtype_code() const { return code_; }
  std::uint64_t tokens() const { return tokens_; }

 private:
  std::string prefix_, bin_tmp_;
  int code_ = 8;
  std::FILE* bin_ = nullptr;
  std::vector<std::int32_t> lengths_;
  std::uint64_t tokens_ = 0;
};

/// The text documents of `path` (JSON lines: each non-empty line's `field`; a file; a
/// folder's files) in order, each given to `each` with where it comes from ("a.jsonl:7").
/// Throws data_error with the file and line for a line that is not JSON or lacks the field.
void for_each_document(const std::string& path, const std::string& field,
                       const std::function<void(std::string&& text, const std::string& where)>& each);

/// The documents' ids, in order, encoded on `threads` threads: each document's
/// tokenizer ids, then `eos` unless it is already the last (eos < 0: nothing appended).
void encode_documents(const std::string& path, const std::string& field, const tokenizer& tok, int eos, int threads,
                      const std::function<void(const std::vector<int>& ids)>& each);

/// The EOS of documents (WORKLOADS.md section 6): the model folder's config.json
/// eos_token_id (its first when a list), else the tokenizer's (`tokenizer_eos`); -1: none.
int document_eos(const std::string& model_dir, int tokenizer_eos);

/// fnv1a over the bytes of `files`, streamed in order: "N bytes, fnv1a H" (16 hex
/// digits). Throws data_error for a file that cannot be read.
std::string files_fingerprint(const std::vector<std::string>& files);

/// What a data path holds, to compare hosts and name caches: its bytes' size and fnv1a (a
/// Megatron dataset: its .idx's bytes and the .bin's size). Throws data_error.
std::string data_fingerprint(const std::string& path);

/// The token ids of a data path: a Megatron dataset's .bin as stored; else its documents
/// encoded with `tok` into the cache in `cache_dir` (written first if missing; `written`
/// says so). `tok` may be null for a Megatron dataset only.
std::shared_ptr<const token_file> data_tokens(const std::string& path, const std::string& field, const tokenizer* tok,
                                              int eos, const std::string& cache_dir, bool* written = nullptr);

}  // namespace troupe
