#pragma once
// Tokenized text (WORKLOADS.md section 5): a SentencePiece BPE tokenizer (Debian's
// libsentencepiece), and the corpus as two token streams kept in a cache file.
//
// The cache: the training split and the validation split, each encoded as one string,
// written once into `<cache dir>/tokens-<fingerprint>.bin` (an atomic rename: node
// processes that race write the same bytes) and memory-mapped by every reader. The
// fingerprint covers the text's bytes (training_data::fingerprint) and the tokenizer
// file's, so a changed text or tokenizer never reads a stale cache; the file's header
// repeats it and a file whose header disagrees is refused.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "compute/data/data.hpp"

namespace troupe {

/// A SentencePiece model file.
class tokenizer {
 public:
  /// Loads `path`; throws data_error naming it (missing, unreadable, not a model).
  explicit tokenizer(const std::string& path);
  ~tokenizer();
  tokenizer(const tokenizer&) = delete;
  tokenizer& operator=(const tokenizer&) = delete;

  const std::string& path() const { return path_; }
  /// Pieces in the vocabulary (the model's vocabulary rounds it up: padded_vocab).
  int size() const;
  /// "<size> pieces, fnv1a <hash of the file's bytes>".
  const std::string& fingerprint() const { return fingerprint_; }
  std::vector<int> encode(const std::string& text) const;
  std::string decode(const std::vector<int>& ids) const;
  /// Bytes each piece stands for (WORKLOADS.md section 5): 1 for a byte piece <0xNN>,
  /// else the UTF-8 bytes of its text with each U+2581 counted as 1; 0 for control pieces.
  std::vector<std::int32_t> piece_bytes() const;

  /// Trains a BPE model with WORKLOADS.md's pinned options on `lines` (each a sentence)
  /// and writes it to `out` atomically. Throws data_error.
  static void train(const std::vector<std::string>& lines, int vocab_size, const std::string& out);

 private:
  std::string path_, fingerprint_;
  void* sp_ = nullptr;  ///< the plugin's processor (compute/data/spm_plugin.hpp)
};

/// The model's vocabulary for a tokenizer of `size` pieces: rounded up to a multiple of
/// 128, the same for every parallel layout.
int padded_vocab(int size);

/// A tokenizer's size and fingerprint, read once per process per path.
struct tokenizer_info {
  int size = 0;
  std::string fingerprint;
};
tokenizer_info tokenizer_info_of(const std::string& path);

/// The corpus as token streams (WORKLOADS.md section 5): windows of seq_len + 1 tokens,
/// training offsets splitmix64(seed * 2^32 + g) mod (n_train_tokens - seq_len), the 32
/// validation windows at i * stride over the validation tokens.
class token_corpus {
 public:
  /// The cache file for `text` (its bytes' fingerprint: training_data::fingerprint) and
  /// `tok` in `cache_dir`, written first if missing. Throws data_error.
  token_corpus(const text_corpus& text, const std::string& text_fingerprint, const tokenizer& tok,
               const std::string& cache_dir);
  ~token_corpus();
  token_corpus(const token_corpus&) = delete;
  token_corpus& operator=(const token_corpus&) = delete;

  std::size_t n_train() const { return n_train_; }
  std::size_t n_valid() const { return n_valid_; }
  const std::string& cache_file() const { return file_; }
  bool written_here() const { return written_; }  ///< this process encoded the text (else: read the cache)
  /// Token `i` of the training stream, then of the validation stream.
  std::int32_t train_token(std::size_t i) const { return ids_[i]; }
  std::int32_t valid_token(std::size_t i) const { return ids_[n_train_ + i]; }

  batch train_batch(std::uint64_t seed, std::uint64_t first, int count, int seq_len) const;
  /// The validation windows; `bytes_per_target` is set from the tokenizer's piece bytes.
  batch validation_batch(int seq_len, const tokenizer& tok, int windows = 32) const;

 private:
  batch windows(const std::vector<std::size_t>& offsets, int seq_len) const;
  std::string file_;
  const std::int32_t* ids_ = nullptr;
  std::size_t n_train_ = 0, n_valid_ = 0, mapped_ = 0;
  void* map_ = nullptr;
  bool written_ = false;
};

/// The token cache's folder where data.cache_dir is empty: this process's
/// set_default_cache_dir, else a folder under the system's temporary folder.
std::string default_cache_dir();
/// Sets default_cache_dir for this process: launch/ does, once, from the environment
/// ($XDG_CACHE_HOME/troupe, else ~/.cache/troupe; each node process from its own host's).
void set_default_cache_dir(const std::string& dir);

}  // namespace troupe
