#pragma once
// Data sets of WORKLOADS.md, loaded from Debian packages, with deterministic sampling:
// a sample depends only on the seed and its global index, never on the parallel layout.
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/types.h>

namespace troupe {

/// Raised when a data set is missing or malformed; the message names the package.
struct data_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// One batch: inputs and targets of a contiguous range of samples.
struct batch {
  torch::Tensor input;   ///< gpt: int64 [B, T] bytes; mlp: float [B, 784]
  torch::Tensor target;  ///< gpt: int64 [B, T] next bytes; mlp: int64 [B]
  /// Documents with --document-attention: int64 [B, T], each input token's position in
  /// its document (document_positions); undefined otherwise. (A per-token loss mask,
  /// for supervised fine-tuning, would travel beside the targets the same way.)
  torch::Tensor positions;
  /// Text: the bytes a target stands for, on average (1 for bytes; a tokenizer's
  /// validation windows: their pieces' bytes; 0: not known, ids without a tokenizer), for
  /// bits per byte.
  double bytes_per_target = 1.0;
};

/// Documents in a window (WORKLOADS.md section 6, --document-attention): the position of
/// each token of `ids` (B, T): 0 at the window's first token and again at each token
/// that follows `eos`, else one more than the token before. (B, T) int64 on ids' device.
torch::Tensor document_positions(const torch::Tensor& ids, std::int64_t eos);

/// A byte-level text corpus (the tokens are the 256 byte values) split 90/10 into
/// training and validation, sampled as WORKLOADS.md says: the fortunes corpus, or a
/// user's own text (data.text).
///
/// Files are memory-mapped (read-only, private), not read: a window's bytes are paged in
/// when it is sampled, and node processes of one machine share the page cache's copy
/// instead of holding one each. The corpus is the files' concatenation (a window may span
/// two files); empty files are left out. A file that shrinks while mapped makes the
/// process fail (SIGBUS) when a window reads past its new end, as with any mapping.
/// Copies of a text_corpus share the mappings.
class text_corpus {
 public:
  static constexpr const char* default_dir = "/usr/share/games/fortunes";

  /// Throws data_error naming the package if `dir` does not exist.
  static void require(const std::string& dir);

  /// The fortunes corpus: every regular file without extension in `dir` (not links), in
  /// byte order of names.
  explicit text_corpus(const std::string& dir = default_dir);
  /// The files the fortunes corpus of `dir` reads, in order (require(dir) first).
  static std::vector<std::string> fortunes_files(const std::string& dir);
  /// A corpus from given bytes (for tests).
  explicit text_corpus(std::vector<std::uint8_t> bytes);
  /// A corpus of given training and validation bytes (data.val_text: no 90/10 split).
  text_corpus(std::vector<std::uint8_t> train, const std::vector<std::uint8_t>& valid);

  /// Tests: every text read from now on is read as if its mapping had failed (a file
  /// system without mmap), until called with false.
  static void fail_mappings_for_testing(bool fail);

  /// A text of one's own (data.text): the file `path`, or every file of the folder `path`
  /// whose name does not start with '.', in byte order of names (links to files count;
  /// subfolders are not read).
  static text_corpus read_text(const std::string& path);
  /// All of the text `train` for training, the text `valid` for the validation windows
  /// (each a file or a folder, as read_text).
  static text_corpus read_text(const std::string& train, const std::string& valid);
  /// The files read_text reads, in order. Throws data_error when `path` is missing, is
  /// neither a file nor a folder, or is a folder without files.
  static std::vector<std::string> text_files(const std::string& path);
  /// The fewest bytes a corpus needs for samples of `seq_len` tokens: a training window
  /// in its first 90 % and the 32 validation windows in the rest.
  static std::size_t min_bytes(int seq_len);
  /// Throws data_error unless the corpus of `files` holds min_bytes(seq_len) (`what` is
  /// empty: `empty_hint` follows); its size.
  static std::size_t require_size(const std::vector<std::string>& files, const std::string& what, int seq_len,
                                  const std::string& empty_hint = "");
  /// The same for a training text and a validation text of their own (data.val_text):
  /// `train` needs a window of seq_len + 1 bytes and one more, `valid` the 32 windows.
  static void require_sizes(const std::vector<std::string>& train, const std::string& train_what,
                            const std::vector<std::string>& valid, const std::string& valid_what, int seq_len);

  std::size_t size() const { return size_; }
  std::size_t n_train() const { return n_train_; }
  std::size_t n_valid() const { return size_ - n_train_; }
  /// A copy of the bytes [begin, begin + count) (clipped to the end; tests).
  std::vector<std::uint8_t> bytes(std::size_t begin = 0, std::size_t count = SIZE_MAX) const;
  /// How many of the bytes are in memory-mapped files (the rest: bytes given in memory).
  std::size_t mapped_bytes() const { return mapped_; }

  /// Start offset of training sample `g` (global index) for `seed`.
  std::size_t train_offset(std::uint64_t seed, std::uint64_t g, int seq_len) const;

  /// Training samples [first, first + count) of the global sample sequence.
  batch train_batch(std::uint64_t seed, std::uint64_t first, int count, int seq_len) const;

  /// The 32 fixed validation windows.
  batch validation_batch(int seq_len, int windows = 32) const;

 private:
  /// A run of the corpus's bytes in one file mapping (or one buffer given in memory).
  struct segment {
    std::size_t begin;          ///< offset of its first byte in the corpus
    const std::uint8_t* data;   ///< its bytes
    std::size_t size;
  };
  struct storage;
  /// Appends the bytes of `files`, in order, each a mapping (`what` names them in errors).
  void map_files(const std::vector<std::string>& files, const std::string& what);
  /// Appends bytes given in memory.
  void add_buffer(std::vector<std::uint8_t> bytes);
  void add(const std::uint8_t* data, std::size_t size);
  /// Copies the bytes [begin, begin + n) into `out`, across segments.
  void copy(std::size_t begin, std::size_t n, std::uint8_t* out) const;
  batch windows(const std::vector<std::size_t>& offsets, int seq_len) const;

  std::shared_ptr<storage> storage_;  ///< the mappings and buffers `segments_` point into
  std::vector<segment> segments_;
  std::size_t size_ = 0;
  std::size_t n_train_ = 0;
  std::size_t mapped_ = 0;
};

/// Fashion-MNIST from the gzipped IDX files of `dataset-fashion-mnist`.
class fashion_mnist {
 public:
  static constexpr const char* default_dir = "/usr/share/datasets/fashion-mnist";
  static constexpr int image_size = 28 * 28;
  static constexpr float mean = 0.2860f;  ///< normalisation of WORKLOADS.md
  static constexpr float stddev = 0.3530f;

  /// Reads the training set, the test set or both (the training set's images are 188 MB
  /// as floats: evaluations and data loaders read only what they use). Reading a set
  /// that was not loaded throws data_error.
  explicit fashion_mnist(const std::string& dir = default_dir, bool training_set = true, bool test_set = true);
  /// Throws data_error naming the package if one of the four files is missing.
  static void require(const std::string& dir);
  /// The four files' paths in `dir` (training images and labels, test images and labels).
  static std::vector<std::string> files(const std::string& dir);

  int train_size() const;
  int test_size() const;

  /// Epoch `e`'s visiting order of the training indices (ascending splitmix key).
  std::vector<std::int64_t> epoch_order(std::uint64_t seed, std::uint64_t epoch) const;

  /// Training positions [first, first + count) of epoch `e`'s order.
  batch train_batch(const std::vector<std::int64_t>& order, std::int64_t first, int count) const;
  batch test_set() const;

 private:
  torch::Tensor train_images_, train_labels_, test_images_, test_labels_;
};

}  // namespace troupe
