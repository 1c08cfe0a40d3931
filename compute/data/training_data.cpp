#include "compute/data/training_data.hpp"

#include <map>
#include <memory>
#include <mutex>
#include <fstream>

#include "compute/data/documents.hpp"
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

/// What `make()` returns, made once per process per `key` while any user holds it (the
/// first user makes it; the others wait for it).
template <class T, class Make>
std::shared_ptr<const T> shared_by_key(const std::string& key, const Make& make) {
  static std::mutex m;
  static std::map<std::string, std::weak_ptr<const T>> held;
  std::lock_guard<std::mutex> lock(m);
  if (auto t = held[key].lock()) return t;
  std::shared_ptr<const T> t = make();
  held[key] = t;
  return t;
}

/// read_corpus, once per process while it is in use: the data loaders of a node's
/// replicas and its evaluation share one copy of the bytes (a text of gigabytes is held
/// once, not once per replica).
std::shared_ptr<const text_corpus> shared_corpus(const job_config& cfg) {
  return shared_by_key<text_corpus>(corpus_key(cfg), [&] { return std::make_shared<const text_corpus>(read_corpus(cfg)); });
}
}  // namespace

/// data.tokenizer and the token streams of data.text (or fortunes) it encodes to.
struct tokenized_text {
  tokenized_text(const job_config& cfg, const text_corpus& text)
      : tok(std::make_unique<tokenizer>(cfg.tokenizer)),
        tokens(std::make_unique<token_corpus>(text, training_data::fingerprint(cfg), *tok, cfg.cache_dir)) {}
  /// The documents of data.data (and data.val_data) as one stream (WORKLOADS.md section 6).
  explicit tokenized_text(const job_config& cfg) {
    const auto name = cfg.text_tokenizer();
    if (!name.empty()) tok = std::make_unique<tokenizer>(name);
    eos = document_eos(cfg.hf_model, tok ? tok->eos_id() : -1);
    std::vector<std::shared_ptr<const token_file>> stream;
    std::size_t n_data = 0;
    for (const auto* list : {&cfg.data, &cfg.val_data})
      for (const auto& path : *list) {
        const auto start = std::chrono::steady_clock::now();
        bool written = false;
        stream.push_back(data_tokens(path, cfg.data_field, tok.get(), eos, cfg.cache_dir, &written));
        if (written)
          spdlog::info("encoded the documents of {} into {} tokens with {} in {:.1f} s: {}", path,
                       stream.back()->size(), name,
                       std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
                       stream.back()->path());
        if (list == &cfg.data) n_data += stream.back()->size();
      }
    // Without validation documents, the first floor(9 n / 10) tokens train.
    const std::size_t n_train = cfg.val_data.empty() ? n_data / 10 * 9 + n_data % 10 * 9 / 10 : n_data;
    tokens = std::make_unique<token_corpus>(std::move(stream), n_train);
  }
  std::unique_ptr<tokenizer> tok;  ///< null: a Megatron dataset's ids without a tokenizer
  std::unique_ptr<token_corpus> tokens;
  int eos = -1;  ///< documents: the id that ends each one (-1: none known)
};

namespace {

/// tokenized_text, once per process while in use (keyed as shared_corpus is: the text is
/// hashed and the tokenizer loaded only for the first user); the cache file is written by
/// the first process that needs it.
std::shared_ptr<const tokenized_text> shared_tokens(const job_config& cfg, const text_corpus& text) {
  const std::string key = corpus_key(cfg) + "\ntokenizer:" + cfg.tokenizer + "\ncache:" + cfg.cache_dir;
  return shared_by_key<tokenized_text>(key, [&] {
    const auto start = std::chrono::steady_clock::now();
    auto t = std::make_shared<const tokenized_text>(cfg, text);
    if (t->tokens->written_here())
      spdlog::info("encoded {} bytes into {} + {} tokens with {} in {:.1f} s: {}", text.size(), t->tokens->n_train(),
                   t->tokens->n_valid(), t->tok->path(),
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
                   t->tokens->cache_file());
    return t;
  });
}

/// What names a data set of documents among a process's users.
std::string documents_key(const job_config& cfg) {
  std::string key = "documents:";
  for (const auto& p : cfg.data) key += p + "\n";
  key += "val:";
  for (const auto& p : cfg.val_data) key += p + "\n";
  return key + "field:" + cfg.data_field + "\ntokenizer:" + cfg.text_tokenizer() + "\nmodel:" + cfg.hf_model +
         "\ncache:" + cfg.cache_dir;
}

/// The documents' token stream, once per process while in use (as shared_tokens).
std::shared_ptr<const tokenized_text> shared_documents(const job_config& cfg) {
  return shared_by_key<tokenized_text>(documents_key(cfg), [&] { return std::make_shared<const tokenized_text>(cfg); });
}

}  // namespace

training_data::training_data(const job_config& cfg, use what) : cfg_(cfg) {
  if (cfg.uses_documents()) {
    tokenized_ = shared_documents(cfg);
    return;
  }
  if (cfg.workload == "fmnist-mlp") {
    images_ = std::make_unique<fashion_mnist>(cfg.fmnist_dir, what != use::evaluation, what != use::training);
    return;
  }
  text_ = shared_corpus(cfg);
  if (!cfg.tokenizer.empty()) tokenized_ = shared_tokens(cfg, *text_);
}

const token_corpus* training_data::tokens() const { return tokenized_ ? tokenized_->tokens.get() : nullptr; }

void training_data::check_available(const job_config& cfg) {
  if (cfg.uses_documents()) {  // their sizes are known once encoded: a short stream fails at its first batch
    for (const auto* list : {&cfg.data, &cfg.val_data})
      for (const auto& path : *list) data_format_of(path);
    return;
  }
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
  if (cfg.uses_documents()) {
    std::string out = "documents";
    for (const auto& p : cfg.data) out += "; " + data_fingerprint(p);
    if (!cfg.val_data.empty()) out += "; validation";
    for (const auto& p : cfg.val_data) out += "; " + data_fingerprint(p);
    return out;
  }
  auto files = cfg.workload == "fmnist-mlp" ? fashion_mnist::files(cfg.fmnist_dir)
               : cfg.text.empty()           ? text_corpus::fortunes_files(cfg.fortunes_dir)
                                            : text_corpus::text_files(cfg.text);
  if (!cfg.val_text.empty()) {  // then the validation text's, in the order they are read
    const auto valid = text_corpus::text_files(cfg.val_text);
    files.insert(files.end(), valid.begin(), valid.end());
  }
  return files_fingerprint(files);
}

std::string training_data::identity(const job_config& cfg) {
  // The tokenizer too: every node must encode the text the same way.
  const auto tok = cfg.text_tokenizer();
  return fingerprint(cfg) + (tok.empty() ? "" : "; tokenizer " + tokenizer_info_of(tok).fingerprint) +
         (cfg.uses_documents() ? "; field " + cfg.data_field : "");
}

/// --document-attention: the positions of `b`'s input tokens in their documents.
batch training_data::with_documents(batch b) const {
  if (cfg_.document_attention) {
    if (!tokenized_ || tokenized_->eos < 0)
      throw data_error("document attention needs the documents' EOS token (config.json's eos_token_id or the "
                       "tokenizer's)");
    b.positions = document_positions(b.input, tokenized_->eos);
  }
  return b;
}

batch training_data::samples(int step, int first, int count) {
  const std::int64_t B = cfg_.global_batch;
  if (tokenized_)
    return with_documents(
        tokenized_->tokens->train_batch(cfg_.seed, std::uint64_t(step) * B + first, count, cfg_.model().decoder.seq_len));
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
  if (tokenized_)
    return with_documents(tokenized_->tokens->validation_batch(cfg_.model().decoder.seq_len, tokenized_->tok.get()));
  return text_ ? text_->validation_batch(cfg_.model().decoder.seq_len) : images_->test_set();
}

std::int64_t training_data::tokens_per_sample() const {
  return text_ || tokenized_ ? cfg_.model().decoder.seq_len : 1;
}

}  // namespace troupe
