// Tokenized text (WORKLOADS.md section 5; compute/data/tokenizer.cpp): a SentencePiece BPE
// tokenizer trained with the pinned options round-trips every byte of the fortunes corpus
// and encodes it exactly as Python's SentencePiece does; the token cache is written once
// and a stale one is never read; the padded vocabulary rows are left out of the softmax;
// a tokenized run resumes bit-identical and reports bits per byte; bad input is named.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "compute/checkpoint/checkpoint.hpp"
#include "compute/data/tokenizer.hpp"
#include "compute/trainer/local_trainer.hpp"
#include "quiet_run.hpp"
#include "test_util.hpp"
#include "build_paths.hpp"

namespace troupe {

namespace fs = std::filesystem;

namespace {

std::vector<std::string> training_lines(const text_corpus& corpus) {
  const auto bytes = corpus.bytes(0, corpus.n_train());
  std::vector<std::string> lines;
  std::string line;
  for (auto b : bytes) {
    if (b != '\n') line.push_back(char(b));
    else if (!line.empty()) lines.push_back(std::move(line)), line.clear();
  }
  return lines;
}

std::vector<std::int32_t> read_ids(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<std::int32_t> ids;
  for (std::int32_t x; in.read(reinterpret_cast<char*>(&x), 4);) ids.push_back(x);
  return ids;
}

/// A text of its own, a tenth of the fortunes corpus: small enough to encode in a moment.
std::string small_text(const test::temp_dir& dir) {
  const text_corpus fortunes;
  const auto bytes = fortunes.bytes(0, 260000);
  std::ofstream(dir / "small.txt", std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
  return dir / "small.txt";
}

}  // namespace

TEST(Tokenizer, RoundTripsTheCorpusAndEncodesAsPythonDoes) {
  test::temp_dir dir;
  const text_corpus fortunes;
  tokenizer::train(training_lines(fortunes), 1024, dir / "tok.model");
  const tokenizer tok(dir / "tok.model");
  EXPECT_EQ(tok.size(), 1024);
  EXPECT_EQ(padded_vocab(tok.size()), 1024);
  EXPECT_EQ(padded_vocab(1000), 1024);
  EXPECT_EQ(padded_vocab(1025), 1152);
  // The cache: both splits, each encoded as one string, and each decodes to its bytes.
  auto cfg = test::gpt_config(1);
  cfg.tokenizer = dir / "tok.model";
  cfg.cache_dir = dir / "cache";
  const token_corpus tokens(fortunes, training_data::fingerprint(cfg), tok, cfg.cache_dir);
  EXPECT_TRUE(tokens.written_here());
  std::vector<int> train(tokens.n_train()), valid(tokens.n_valid());
  for (std::size_t i = 0; i < train.size(); ++i) train[i] = tokens.train_token(i);
  for (std::size_t i = 0; i < valid.size(); ++i) valid[i] = tokens.valid_token(i);
  const auto train_bytes = fortunes.bytes(0, fortunes.n_train()), valid_bytes = fortunes.bytes(fortunes.n_train());
  EXPECT_EQ(tok.decode(train), std::string(train_bytes.begin(), train_bytes.end()));
  EXPECT_EQ(tok.decode(valid), std::string(valid_bytes.begin(), valid_bytes.end()));
  EXPECT_LT(tokens.n_train(), fortunes.n_train() / 2) << "a BPE of 1024 pieces should halve the length at least";
  // Python's SentencePiece, same model, same text: the same ids.
  const std::string cmd = std::string("/usr/bin/python3 ") + troupe::test::source_dir + "/tests/support/python/sp_encode.py " +
                          (dir / "tok.model") + " " + (dir / "py");
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  const auto py_train = read_ids(dir / "py.train"), py_valid = read_ids(dir / "py.valid");
  EXPECT_EQ(std::vector<std::int32_t>(train.begin(), train.end()), py_train);
  EXPECT_EQ(std::vector<std::int32_t>(valid.begin(), valid.end()), py_valid);
  // A second reader maps the same file; nothing is encoded again.
  const token_corpus again(fortunes, training_data::fingerprint(cfg), tok, cfg.cache_dir);
  EXPECT_FALSE(again.written_here());
  EXPECT_EQ(again.cache_file(), tokens.cache_file());
  EXPECT_EQ(again.n_train(), tokens.n_train());
  // The bytes each piece stands for (WORKLOADS.md section 5: a byte piece 1, another its
  // UTF-8 bytes with each U+2581 counted 1) add up to the split's bytes exactly.
  const auto piece_bytes = tok.piece_bytes();
  std::int64_t valid_total = 0;
  for (std::size_t i = 0; i < tokens.n_valid(); ++i) valid_total += piece_bytes.at(std::size_t(tokens.valid_token(i)));
  EXPECT_EQ(valid_total, std::int64_t(fortunes.n_valid()));
  // Validation windows over tokens, with the bytes their targets stand for.
  const auto v = tokens.validation_batch(128, &tok);
  EXPECT_EQ(v.input.size(0), 32);
  EXPECT_EQ(v.input[0][0].item<std::int64_t>(), tokens.valid_token(0));
  EXPECT_GT(v.bytes_per_target, 1.5);
  EXPECT_LT(v.bytes_per_target, 6.0);
}

TEST(Tokenizer, TheCacheFollowsTheTextAndTheTokenizerAndRefusesAStaleFile) {
  test::temp_dir dir;
  const auto text = small_text(dir);
  const auto corpus = text_corpus::read_text(text);
  tokenizer::train(training_lines(corpus), 400, dir / "a.model");
  tokenizer::train(training_lines(corpus), 420, dir / "b.model");
  auto cfg = test::gpt_config(1);
  cfg.text = text;
  const tokenizer a(dir / "a.model"), b(dir / "b.model");
  const token_corpus first(corpus, training_data::fingerprint(cfg), a, dir / "cache");
  EXPECT_TRUE(first.written_here());
  const token_corpus other_tokenizer(corpus, training_data::fingerprint(cfg), b, dir / "cache");
  EXPECT_TRUE(other_tokenizer.written_here());
  EXPECT_NE(other_tokenizer.cache_file(), first.cache_file());
  // Another text: another cache file (the first one is never read for it).
  {
    std::ofstream(text, std::ios::app) << "one more line\n";
  }
  const auto changed = text_corpus::read_text(text);
  const token_corpus third(changed, training_data::fingerprint(cfg), a, dir / "cache");
  EXPECT_TRUE(third.written_here());
  EXPECT_NE(third.cache_file(), first.cache_file());
  // A file under the right name whose header disagrees (copied over it): refused.
  fs::copy_file(other_tokenizer.cache_file(), third.cache_file(), fs::copy_options::overwrite_existing);
  try {
    token_corpus stale(changed, training_data::fingerprint(cfg), a, dir / "cache");
    ADD_FAILURE() << "a stale cache was read";
  } catch (const data_error& e) {
    EXPECT_NE(std::string(e.what()).find("is not the cache of this text and tokenizer"), std::string::npos) << e.what();
  }
}

// The padded rows (a tokenizer's size rounded up to 128) never take probability: their
// logits are minus infinity and the loss is that of the unpadded vocabulary.
TEST(Tokenizer, PaddedLogitsAreLeftOutOfTheSoftmax) {
  auto c = test::gpt_config(1);
  c.workload = "llama-tiny";
  c.layers = 1;
  c.vocab = 384;
  auto spec = c.model();
  spec.decoder.vocab_used = 300;
  layer_range whole;
  whole.last = 1;
  const auto model = make_slice(spec, whole, initial_state(spec, 3));
  const auto x = torch::randint(0, 300, {2, 16}), y = torch::randint(0, 300, {2, 16});
  const auto out = model->forward(x);
  const auto logits = model->logits(out);
  EXPECT_TRUE(torch::all(torch::isinf(logits.narrow(-1, 300, 84))).item<bool>());
  const auto used = logits.narrow(-1, 0, 300);
  const auto expected = torch::nn::functional::cross_entropy(used.reshape({-1, 300}), y.reshape({-1}));
  EXPECT_NEAR(model->loss(out, y).item<double>(), expected.item<double>(), 1e-6);
  model->loss(out, y).backward();
  const auto& head = model->param("lm_head.weight").grad();
  EXPECT_EQ(head.narrow(0, 300, 84).abs().sum().item<double>(), 0.0) << "padded rows got a gradient";
  EXPECT_GT(head.narrow(0, 0, 300).abs().sum().item<double>(), 0.0);
}

// A tokenized run (llama, its vocabulary padded from the tokenizer's 400 pieces to 512):
// stopped at step 2 and resumed from its checkpoint folder, it ends bit-identical to a
// straight run; validation reports bits per byte; another tokenizer cannot resume it.
TEST(Tokenizer, ATokenizedRunResumesBitIdentical) {
  test::temp_dir dir;
  const auto text = small_text(dir);
  tokenizer::train(training_lines(text_corpus::read_text(text)), 400, dir / "tok.model");
  auto c = test::gpt_config(4);
  c.workload = "llama-tiny";
  c.layers = 2;
  c.d_model = 64;
  c.seq_len = 64;
  c.text = text;
  c.tokenizer = dir / "tok.model";
  c.cache_dir = dir / "cache";
  c.pipeline = 2;
  c.microbatches = 4;
  c.threads = 1;
  c.eval_interval = 2;
  c.validate();
  EXPECT_EQ(c.model().decoder.vocab, 512);
  EXPECT_EQ(c.model().decoder.vocab_used, 400);
  const auto straight = test::run_quietly(c);
  ASSERT_EQ(straight.exit_code, 0) << straight.error;
  ASSERT_EQ(straight.evaluations.size(), 2u);
  const auto& e = straight.evaluations.back();
  EXPECT_GT(e.bytes_per_target, 1.2);
  EXPECT_NEAR(e.bits_per_byte(), e.loss / std::log(2.0) / e.bytes_per_target, 1e-12);

  auto first = c;
  first.checkpoint_dir = dir / "ck";
  first.checkpoint_interval = 2;
  ASSERT_EQ(test::run_quietly(first).exit_code, 0);
  auto resumed = c;
  resumed.resume = dir / "ck/step-00000002";
  const auto second = test::run_quietly(resumed);
  ASSERT_EQ(second.exit_code, 0) << second.error;
  EXPECT_EQ(test::max_abs_diff(second.final_state, straight.final_state), 0.0);

  tokenizer::train(training_lines(text_corpus::read_text(text)), 420, dir / "other.model");
  // The same tokenizer moved elsewhere resumes; another one (same vocabulary rows) does not.
  fs::copy_file(dir / "tok.model", dir / "moved.model");
  auto moved = resumed;
  moved.tokenizer = dir / "moved.model";
  const auto again = test::run_quietly(moved);
  ASSERT_EQ(again.exit_code, 0) << again.error;
  EXPECT_EQ(test::max_abs_diff(again.final_state, straight.final_state), 0.0);
  auto other = resumed;
  other.tokenizer = dir / "other.model";
  try {
    const auto refused = test::run_quietly(other);
    ADD_FAILURE() << "resumed with another tokenizer (exit " << refused.exit_code << ")";
  } catch (const checkpoint_error& e) {
    EXPECT_NE(std::string(e.what()).find("was trained with a tokenizer of 400 pieces"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("other.model has 420 pieces"), std::string::npos) << e.what();
  }
}

TEST(Tokenizer, BadTokenizersAreNamed) {
  test::temp_dir dir;
  auto c = test::gpt_config(1);
  c.tokenizer = dir / "missing.model";
  try {
    c.validate();
    ADD_FAILURE() << "a missing tokenizer was accepted";
  } catch (const config_error& e) {
    EXPECT_NE(std::string(e.what()).find("tokenizer " + (dir / "missing.model") + " does not exist"), std::string::npos)
        << e.what();
  }
  std::ofstream(dir / "corrupt.model") << "not a sentencepiece model at all";
  c.tokenizer = dir / "corrupt.model";
  try {
    c.validate();
    ADD_FAILURE() << "a corrupt tokenizer was accepted";
  } catch (const config_error& e) {
    EXPECT_NE(std::string(e.what()).find("is not a SentencePiece model"), std::string::npos) << e.what();
  }
  c.workload = "fmnist-mlp";
  EXPECT_THROW(c.validate(), config_error);
}

}  // namespace troupe
