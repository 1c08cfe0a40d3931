#pragma once
// The training data of a workload: a step's samples, independent of the layout (the text
// corpus read once per process while it is in use, its token streams, Fashion-MNIST).
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "compute/config/job_config.hpp"
#include "compute/data/data.hpp"
#include "compute/data/tokenizer.hpp"

namespace troupe {

/// The training data of a workload: a step's samples, independent of the layout.
class training_data {
 public:
  /// What a user of the data reads: Fashion-MNIST loads only that part (a data loader
  /// no test set, an evaluation no training set); a text corpus is read whole, once per
  /// process while any training_data holds it.
  enum class use { training, evaluation, both };
  explicit training_data(const job_config& cfg, use what = use::both);
  /// Throws data_error (naming the package) if the workload's data is not installed, or
  /// (data.text) the text is missing or too short for the model's seq_len.
  static void check_available(const job_config& cfg);
  /// What the workload's data files hold, to compare hosts (every node must read the
  /// same): "4123456 bytes, fnv1a 0123456789abcdef" over the files the workload reads, in
  /// the order it reads them. Throws data_error as reading them would.
  static std::string fingerprint(const job_config& cfg);
  /// fingerprint, and the tokenizer's (data.tokenizer): what every node must agree on.
  static std::string identity(const job_config& cfg);
  /// Samples [first, first + count) of step `step`'s global batch.
  batch samples(int step, int first, int count);
  /// gpt: the validation windows; mlp: the test set.
  batch evaluation_set() const;
  std::int64_t tokens_per_sample() const;
  /// The text it samples (null for Fashion-MNIST).
  const text_corpus* corpus() const { return text_.get(); }
  /// data.tokenizer: the token streams it samples instead of the text's bytes.
  const token_corpus* tokens() const;

 private:
  /// `b` with its positions in their documents under --document-attention.
  batch with_documents(batch b) const;
  job_config cfg_;
  std::shared_ptr<const text_corpus> text_;  ///< shared by the process's users of the same corpus
  std::shared_ptr<const struct tokenized_text> tokenized_;  ///< data.tokenizer's; shared as the text is
  std::unique_ptr<fashion_mnist> images_;
  int order_epoch_ = -1;
  std::vector<std::int64_t> order_;
};

}  // namespace troupe
