#include "compute/data/training_data.hpp"

#include <map>
#include <memory>
#include <mutex>
#include <fstream>

#include "compute/runtime/splitmix.hpp"

namespace troupe {

namespace {
/// The gpt workloads' corpus: data.text (and data.val_text), else the fortunes corpus.
text_corpus read_corpus(const job_config& cfg) {
  if (cfg.text.empty()) return text_corpus(cfg.fortunes_dir);
  return cfg.val_text.empty() ? text_corpus::read_text(cfg.text) : text_corpus::read_text(cfg.text, cfg.val_text);
}

/// What names a corpus among a process's users: its paths.
std::string corpus_key(const job_config& cfg) {
  return cfg.text.empty() ? "fortunes:" + cfg.fortunes_dir : "text:" + cfg.text + "\nval:" + cfg.val_text;
}

/// read_corpus, once per process while it is in use: the data loaders of a node's
/// replicas and its evaluation share one copy of the bytes (a text of gigabytes is held
/// once, not once per replica).
std::shared_ptr<const text_corpus> shared_corpus(const job_config& cfg) {
  static std::mutex m;
  static std::map<std::string, std::weak_ptr<const text_corpus>> held;
  const std::string key = corpus_key(cfg);
  std::lock_guard<std::mutex> lock(m);
  if (auto corpus = held[key].lock()) return corpus;
  auto corpus = std::make_shared<const text_corpus>(read_corpus(cfg));
  held[key] = corpus;
  return corpus;
}
}  // namespace

/// data.tokenizer and the token streams of data.text (or fortunes) it encodes to.
struct tokenized_text {
  tokenized_text(const job_config& cfg, const text_corpus& text)
      : tok(cfg.tokenizer), tokens(text, training_data::fingerprint(cfg), tok, cfg.cache_dir) {}
  tokenizer tok;
  token_corpus tokens;
};

namespace {

/// tokenized_text, once per process while in use (keyed as shared_corpus is: the text is
/// hashed and the tokenizer loaded only for the first user); the cache file is written by
/// the first process that needs it.
std::shared_ptr<const tokenized_text> shared_tokens(const job_config& cfg, const text_corpus& text) {
  static std::mutex m;
  static std::map<std::string, std::weak_ptr<const tokenized_text>> held;
  const std::string key = corpus_key(cfg) + "\ntokenizer:" + cfg.tokenizer + "\ncache:" + cfg.cache_dir;
  std::lock_guard<std::mutex> lock(m);
  if (auto t = held[key].lock()) return t;
  const auto start = std::chrono::steady_clock::now();
  auto t = std::make_shared<const tokenized_text>(cfg, text);
  if (t->tokens.written_here())
    spdlog::info("encoded {} bytes into {} + {} tokens with {} in {:.1f} s: {}", text.size(), t->tokens.n_train(),
                 t->tokens.n_valid(), t->tok.path(),
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), t->tokens.cache_file());
  held[key] = t;
  return t;
}

}  // namespace

training_data::training_data(const job_config& cfg, use what) : cfg_(cfg) {
  if (cfg.workload == "fmnist-mlp") {
    images_ = std::make_unique<fashion_mnist>(cfg.fmnist_dir, what != use::evaluation, what != use::training);
    return;
  }
  text_ = shared_corpus(cfg);
  if (!cfg.tokenizer.empty()) tokenized_ = shared_tokens(cfg, *text_);
}

const token_corpus* training_data::tokens() const { return tokenized_ ? &tokenized_->tokens : nullptr; }

void training_data::check_available(const job_config& cfg) {
  if (cfg.workload == "fmnist-mlp") return fashion_mnist::require(cfg.fmnist_dir);
  const auto seq_len = cfg.model().decoder.seq_len;
  if (!cfg.val_text.empty())
    text_corpus::require_sizes(text_corpus::text_files(cfg.text), "text corpus " + cfg.text,
                               text_corpus::text_files(cfg.val_text), "validation text " + cfg.val_text, seq_len);
  else if (!cfg.text.empty())
    text_corpus::require_size(text_corpus::text_files(cfg.text), "text corpus " + cfg.text, seq_len);
  else
    text_corpus::require_size(text_corpus::fortunes_files(cfg.fortunes_dir), "fortunes corpus in " + cfg.fortunes_dir,
                              seq_len, " (install it: apt-get install fortunes)");
}

std::string training_data::fingerprint(const job_config& cfg) {
  check_available(cfg);  // an empty or too short text fails here, not in a data loader
  auto files = cfg.workload == "fmnist-mlp" ? fashion_mnist::files(cfg.fmnist_dir)
               : cfg.text.empty()           ? text_corpus::fortunes_files(cfg.fortunes_dir)
                                            : text_corpus::text_files(cfg.text);
  if (!cfg.val_text.empty()) {  // then the validation text's, in the order they are read
    const auto valid = text_corpus::text_files(cfg.val_text);
    files.insert(files.end(), valid.begin(), valid.end());
  }
  std::uint64_t hash = fnv1a_basis, bytes = 0;  // over the files streamed in order
  std::vector<char> chunk(1 << 20);
  for (const auto& file : files) {
    std::ifstream in(file, std::ios::binary);
    if (!in) throw data_error("cannot read " + file);
    while (in) {
      in.read(chunk.data(), std::streamsize(chunk.size()));
      const auto n = std::size_t(in.gcount());
      hash = fnv1a(chunk.data(), n, hash);
      bytes += n;
    }
    if (in.bad()) throw data_error("cannot read " + file);
  }
  char text[64];
  std::snprintf(text, sizeof text, "%llu bytes, fnv1a %016llx", static_cast<unsigned long long>(bytes),
                static_cast<unsigned long long>(hash));
  return text;
}

std::string training_data::identity(const job_config& cfg) {
  // The tokenizer too: every node must encode the text the same way.
  return fingerprint(cfg) + (cfg.tokenizer.empty() ? "" : "; tokenizer " + tokenizer_info_of(cfg.tokenizer).fingerprint);
}

batch training_data::samples(int step, int first, int count) {
  const std::int64_t B = cfg_.global_batch;
  if (tokenized_) return tokenized_->tokens.train_batch(cfg_.seed, std::uint64_t(step) * B + first, count, cfg_.model().decoder.seq_len);
  if (text_) return text_->train_batch(cfg_.seed, std::uint64_t(step) * B + first, count, cfg_.model().decoder.seq_len);
  // Fashion-MNIST: step t of epoch e takes positions [B t, B t + B) of e's order.
  const int per_epoch = images_->train_size() / int(B);
  const int epoch = step / per_epoch;
  if (epoch != order_epoch_) {
    order_ = images_->epoch_order(cfg_.seed, epoch);
    order_epoch_ = epoch;
  }
  return images_->train_batch(order_, std::int64_t(step % per_epoch) * B + first, count);
}

batch training_data::evaluation_set() const {
  if (tokenized_) return tokenized_->tokens.validation_batch(cfg_.model().decoder.seq_len, tokenized_->tok);
  return text_ ? text_->validation_batch(cfg_.model().decoder.seq_len) : images_->test_set();
}

std::int64_t training_data::tokens_per_sample() const { return text_ ? cfg_.model().decoder.seq_len : 1; }

}  // namespace troupe
