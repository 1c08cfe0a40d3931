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

/// A tokenizer: a SentencePiece model file (WORKLOADS.md section 5: its pieces, nothing
/// added), a Hugging Face tokenizer.json (compute/data/hf_tokenizer.hpp), or a model
/// folder's tokenizer as AutoTokenizer.from_pretrained(DIR) encodes (its tokenizer.json,
/// else its tokenizer.model, with tokenizer_config.json's special tokens).
class tokenizer {
 public:
  /// Loads `path` (a file or a model folder); throws data_error naming it (missing,
  /// unreadable, not a tokenizer, a model type Troupe does not read).
  explicit tokenizer(const std::string& path);
  ~tokenizer();
  tokenizer(const tokenizer&) = delete;
  tokenizer& operator=(const tokenizer&) = delete;

  const std::string& path() const { return path_; }
  /// Pieces in the vocabulary (the model's vocabulary rounds it up: padded_vocab).
  int size() const;
  /// "<size> pieces, fnv1a <hash of the file's bytes>".
  const std::string& fingerprint() const { return fingerprint_; }
  /// The ids of `text` (a folder's: with its special tokens, as AutoTokenizer's call).
  /// Thread-safe.
  std::vector<int> encode(const std::string& text) const;
  std::string decode(const std::vector<int>& ids) const;
  /// Bytes each piece stands for (WORKLOADS.md section 5): 1 for a byte piece <0xNN>,
  /// else the UTF-8 bytes of its text with each U+2581 counted as 1; 0 for control pieces.
  std::vector<std::int32_t> piece_bytes() const;
  /// The tokenizer's end-of-sequence id (tokenizer_config.json's eos_token; a
  /// SentencePiece model's </s>); -1: none.
  int eos_id() const;
  /// "SentencePiece", "byte-level BPE", ..., for logs.
  std::string describe() const;
  /// Whether the folder `dir` holds a tokenizer (tokenizer.json or tokenizer.model).
  static bool in_folder(const std::string& dir);

  /// Trains a BPE model with WORKLOADS.md's pinned options on `lines` (each a sentence)
  /// and writes it to `out` atomically. Throws data_error.
  static void train(const std::vector<std::string>& lines, int vocab_size, const std::string& out);

 private:
  struct impl;
  std::string path_, fingerprint_;
  std::unique_ptr<impl> impl_;
};

/// The model's vocabulary for a tokenizer of `size` pieces: rounded up to a multiple of
/// 128, the same for every parallel layout.
int padded_vocab(int size);

/// A tokenizer's size and fingerprint, read once per process per path.
struct tokenizer_info {
  int size = 0;
  std::string fingerprint;
  int eos = -1;  ///< eos_id()
};
tokenizer_info tokenizer_info_of(const std::string& path);

/// Token ids in a read-only memory-mapped file: a token cache, or a Megatron dataset's
/// .bin (its dtype from the .idx: compute/data/documents.hpp).
class token_file {
 public:
  /// The `count` ids of `width` bytes (1, 2, 4 or 8; `is_signed`) at byte `offset` of
  /// `path`. Throws data_error naming `what` when the file is shorter.
  token_file(const std::string& path, std::size_t offset, std::size_t count, int width, bool is_signed,
             const std::string& what);
  ~token_file();
  token_file(const token_file&) = delete;
  token_file& operator=(const token_file&) = delete;
  std::size_t size() const { return count_; }
  const std::string& path() const { return path_; }
  std::int64_t operator[](std::size_t i) const;

 private:
  std::string path_;
  const unsigned char* ids_ = nullptr;
  std::size_t count_ = 0, mapped_ = 0;
  int width_ = 4;
  bool signed_ = true;
  void* map_ = nullptr;
};

/// The corpus as token streams (WORKLOADS.md sections 5 and 6): windows of seq_len + 1
/// tokens, training offsets splitmix64(seed * 2^32 + g) mod (n_train_tokens - seq_len),
/// the 32 validation windows at i * stride over the validation tokens. The stream is a
/// concatenation of token files; its first n_train tokens train, the rest validate.
class token_corpus {
 public:
  /// The cache file for `text` (its bytes' fingerprint: training_data::fingerprint) and
  /// `tok` in `cache_dir`, written first if missing. Throws data_error.
  token_corpus(const text_corpus& text, const std::string& text_fingerprint, const tokenizer& tok,
               const std::string& cache_dir);
  /// The concatenation of `stream`; its first `n_train` tokens train.
  token_corpus(std::vector<std::shared_ptr<const token_file>> stream, std::size_t n_train);
  ~token_corpus();
  token_corpus(const token_corpus&) = delete;
  token_corpus& operator=(const token_corpus&) = delete;

  std::size_t n_train() const { return n_train_; }
  std::size_t n_valid() const { return n_valid_; }
  /// The text's cache file (the first of the stream's files).
  const std::string& cache_file() const { return stream_.front()->path(); }
  bool written_here() const { return written_; }  ///< this process encoded the text (else: read the cache)
  /// Token `i` of the training stream, then of the validation stream.
  std::int64_t train_token(std::size_t i) const { return token(i); }
  std::int64_t valid_token(std::size_t i) const { return token(n_train_ + i); }

  batch train_batch(std::uint64_t seed, std::uint64_t first, int count, int seq_len) const;
  /// The validation windows; `bytes_per_target` is set from the tokenizer's piece bytes
  /// (null: 0, not known).
  batch validation_batch(int seq_len, const tokenizer* tok, int windows = 32) const;

 private:
  std::int64_t token(std::size_t i) const;
  batch windows(const std::vector<std::size_t>& offsets, int seq_len) const;
  std::vector<std::shared_ptr<const token_file>> stream_;
  std::vector<std::size_t> begins_;  ///< each file's first token in the stream
  std::size_t n_train_ = 0, n_valid_ = 0;
  bool written_ = false;
};

/// The token cache's folder where data.cache_dir is empty: this process's
/// set_default_cache_dir, else a folder under the system's temporary folder.
std::string default_cache_dir();
/// Sets default_cache_dir for this process: launch/ does, once, from the environment
/// ($XDG_CACHE_HOME/troupe, else ~/.cache/troupe; each node process from its own host's).
void set_default_cache_dir(const std::string& dir);

}  // namespace troupe
