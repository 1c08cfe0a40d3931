#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <set>

#include "compute/data/data.hpp"
#include "compute/runtime/splitmix.hpp"
#include "compute/trainer/local_trainer.hpp"
#include "temp_dir.hpp"

namespace troupe {

TEST(Data, FortunesSampleDependsOnlyOnSeedAndGlobalIndex) {
  text_corpus corpus;
  const auto whole = corpus.train_batch(1234, 64, 8, 128);
  for (int i = 0; i < 8; ++i) {
    const auto one = corpus.train_batch(1234, 64 + i, 1, 128);
    EXPECT_TRUE(torch::equal(whole.input[i], one.input[0]));
    EXPECT_TRUE(torch::equal(whole.target[i], one.target[0]));
  }
  // Target is the input shifted by one byte, taken from the corpus at the offset.
  const auto off = corpus.train_offset(1234, 64, 128);
  EXPECT_EQ(whole.input[0][0].item<std::int64_t>(), corpus.bytes(off, 1).at(0));
  EXPECT_EQ(whole.target[0][127].item<std::int64_t>(), corpus.bytes(off + 128, 1).at(0));
  EXPECT_TRUE(torch::equal(whole.input[0].slice(0, 1), whole.target[0].slice(0, 0, 127)));
  EXPECT_FALSE(torch::equal(corpus.train_batch(1, 64, 1, 128).input, corpus.train_batch(2, 64, 1, 128).input));
}

TEST(Data, FortunesValidationWindowsAreFixedAndInTheValidationSplit) {
  text_corpus corpus;
  const auto v = corpus.validation_batch(128);
  ASSERT_EQ(v.input.sizes(), (std::vector<std::int64_t>{32, 128}));
  const std::size_t stride = (corpus.n_valid() - 129) / 32;
  for (int i : {0, 17, 31})
    EXPECT_EQ(v.input[i][0].item<std::int64_t>(), corpus.bytes(corpus.n_train() + i * stride, 1).at(0));
}

TEST(Data, MissingFortunesNamesThePackage) {
  try {
    text_corpus corpus("/nonexistent/fortunes");
    FAIL() << "no error for a missing corpus";
  } catch (const data_error& e) {
    EXPECT_NE(std::string(e.what()).find("apt-get install fortunes"), std::string::npos) << e.what();
  }
}

// launch/troupe compares hosts' data by this fingerprint: the bytes the corpus reads (files
// without an extension, in name order), their count and FNV-1a hash. A corpus the job
// cannot sample (empty, or too short for its seq_len) has none: the error comes first.
TEST(Data, FingerprintIsTheSizeAndHashOfTheBytesRead) {
  troupe::test::temp_dir dir;
  troupe::job_config cfg;
  cfg.fortunes_dir = dir.path.string();
  cfg.seq_len = 8;  // needs 401 bytes
  try {
    troupe::training_data::fingerprint(cfg);
    ADD_FAILURE() << "no error for an empty corpus";
  } catch (const troupe::data_error& e) {
    EXPECT_EQ(std::string(e.what()), "fortunes corpus in " + cfg.fortunes_dir + " is empty (install it: apt-get install fortunes)");
  }
  std::ofstream(dir / "b") << "llo";
  std::ofstream(dir / "a") << "he";
  std::ofstream(dir / "b.dat") << "not read";
  EXPECT_THROW(troupe::training_data::fingerprint(cfg), troupe::data_error);  // 5 bytes: too few
  std::ofstream(dir / "b") << "llo" << std::string(400, 'x');
  // FNV-1a of "hello" and 400 x's (Python: h = (h ^ c) * 0x100000001b3 mod 2^64, from 0xcbf29ce484222325)
  EXPECT_EQ(troupe::training_data::fingerprint(cfg), "405 bytes, fnv1a b9ee0316de9f59cb");
  std::ofstream(dir / "b") << "lp" << std::string(400, 'x');
  EXPECT_EQ(troupe::training_data::fingerprint(cfg).substr(0, 10), "404 bytes,");
}

// data.text: a file whole, or a folder's files (not its dot files, not its subfolders; a
// link to a file counts) in byte order of names; a missing path, an empty folder, an
// empty file are errors; the fewest bytes for a seq_len hold a training window and the
// 32 validation windows, one byte fewer does not.
TEST(Data, TextCorpusIsAFileOrTheFilesOfAFolder) {
  troupe::test::temp_dir tmp;
  const std::filesystem::path dir = tmp.path;
  const auto file = (dir / "one.txt").string();
  std::ofstream(file) << "hello world";
  EXPECT_EQ(text_corpus::text_files(file), std::vector<std::string>{file});
  const auto whole = text_corpus::read_text(file).bytes();
  EXPECT_EQ(std::string(whole.begin(), whole.end()), "hello world");

  const auto folder = dir / "texts";
  std::filesystem::create_directories(folder / "sub");
  std::ofstream(folder / "b.md") << " world";
  std::ofstream(folder / "a.txt") << "hello";
  std::ofstream(folder / ".hidden") << "not read";
  std::ofstream(folder / "sub" / "c") << "not read";
  std::filesystem::create_symlink(file, folder / "c-link");
  const auto files = text_corpus::text_files(folder.string());
  ASSERT_EQ(files.size(), 3u);
  EXPECT_EQ(files[0], (folder / "a.txt").string());
  EXPECT_EQ(files[2], (folder / "c-link").string());
  const auto joined = text_corpus::read_text(folder.string()).bytes();
  EXPECT_EQ(std::string(joined.begin(), joined.end()), "hello worldhello world");

  auto error_of = [](auto&& f) -> std::string {
    try {
      f();
    } catch (const data_error& e) {
      return e.what();
    }
    return "no error";
  };
  EXPECT_EQ(error_of([&] { text_corpus::read_text((dir / "none").string()); }),
            "text corpus not found: " + (dir / "none").string() + " does not exist");
  std::filesystem::create_directories(dir / "empty" / ".git");
  EXPECT_EQ(error_of([&] { text_corpus::read_text((dir / "empty").string()); }),
            "text corpus folder " + (dir / "empty").string() + " holds no files");
  std::ofstream(dir / "zero");
  EXPECT_EQ(error_of([&] { text_corpus::read_text((dir / "zero").string()); }),
            "text corpus " + (dir / "zero").string() + " is empty");

  for (const int seq_len : {8, 64, 128, 1024}) {
    const auto n = text_corpus::min_bytes(seq_len);
    const text_corpus enough(std::vector<std::uint8_t>(n, 'x')), short_(std::vector<std::uint8_t>(n - 1, 'x'));
    EXPECT_NO_THROW(enough.validation_batch(seq_len)) << seq_len;
    EXPECT_NO_THROW(enough.train_batch(1, 0, 4, seq_len)) << seq_len;
    EXPECT_THROW(short_.validation_batch(seq_len), data_error) << seq_len;
  }
  EXPECT_EQ(text_corpus::min_bytes(128), 1601u);
  EXPECT_EQ(error_of([&] { text_corpus::require_size({file}, "text corpus one.txt", 8); }),
            "text corpus one.txt holds 11 bytes: too few for seq_len 8, which needs at least 401 (a training window "
            "in the first 90 %, 32 validation windows in the rest)");
  // data.val_text: all of the training text trains, the validation windows come from the
  // other; each needs its own windows, no more.
  const text_corpus split(std::vector<std::uint8_t>(100, 'a'), std::vector<std::uint8_t>(41, 'b'));
  EXPECT_EQ(split.n_train(), 100u);
  EXPECT_EQ(split.n_valid(), 41u);
  EXPECT_TRUE((split.validation_batch(8).target == 'b').all().item<bool>());
  EXPECT_TRUE((split.train_batch(1, 0, 64, 8).target == 'a').all().item<bool>());
  auto sized = [&](const char* name, std::size_t n) {
    std::ofstream(dir / name) << std::string(n, 'x');
    return std::vector<std::string>{(dir / name).string()};
  };
  EXPECT_NO_THROW(text_corpus::require_sizes(sized("t10", 10), "t", sized("v41", 41), "v", 8));
  EXPECT_EQ(error_of([&] { text_corpus::require_sizes(sized("t9", 9), "t", sized("v41", 41), "v", 8); }),
            "t holds 9 bytes: too few for seq_len 8, which needs at least 10 (a training window)");
  EXPECT_EQ(error_of([&] { text_corpus::require_sizes(sized("t10", 10), "t", sized("v40", 40), "v", 8); }),
            "v holds 40 bytes: too few for seq_len 8, which needs at least 41 (32 validation windows)");
  std::ofstream(dir / "enough") << std::string(401, 'x');
  EXPECT_EQ(text_corpus::require_size({file, (dir / "enough").string()}, "t", 8), 412u);
}

namespace {
/// This process's anonymous resident memory (heap, not file mappings), in bytes.
std::int64_t anonymous_resident_bytes() {
  std::ifstream status("/proc/self/status");
  std::string key;
  std::int64_t kb = -1;
  while (status >> key) {
    if (key == "RssAnon:") {
      status >> kb;
      break;
    }
    status.ignore(1 << 12, '\n');
  }
  return kb * 1024;
}

std::vector<std::uint8_t> pseudo_text(std::size_t n, std::uint64_t seed) {
  std::vector<std::uint8_t> out(n);
  for (std::size_t i = 0; i < n; ++i) out[i] = std::uint8_t(splitmix64(seed + i) % 251);
  return out;
}

void write_bytes(const std::string& path, const std::vector<std::uint8_t>& bytes) {
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
}
}  // namespace

// A text is mapped from its files, not read: the corpus of a folder is the
// concatenation of its files (empty ones left out), windows spanning two files included,
// and samples, validation windows and --val-text splits are those of the same bytes in
// memory.
TEST(Data, MappedTextGivesTheSamplesOfItsBytesInMemory) {
  troupe::test::temp_dir dir;
  std::filesystem::create_directories(dir.path / "texts");
  const std::vector<std::size_t> sizes{300, 0, 517, 2, 9, 1200};
  std::vector<std::uint8_t> all;
  std::vector<std::size_t> ends;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    const auto part = pseudo_text(sizes[i], 1000 * i);
    write_bytes(dir / ("texts/part-" + std::to_string(i)), part);
    all.insert(all.end(), part.begin(), part.end());
    ends.push_back(all.size());
  }
  const auto mapped = text_corpus::read_text(dir / "texts");
  const text_corpus in_memory(all);
  ASSERT_EQ(mapped.size(), all.size());
  EXPECT_EQ(mapped.mapped_bytes(), all.size());
  EXPECT_EQ(in_memory.mapped_bytes(), 0u);
  EXPECT_EQ(mapped.n_train(), in_memory.n_train());
  EXPECT_EQ(mapped.bytes(), all);
  EXPECT_EQ(mapped.bytes(299, 4), std::vector<std::uint8_t>(all.begin() + 299, all.begin() + 303));  // 2 files
  EXPECT_EQ(mapped.bytes(all.size() - 3, 10).size(), 3u);
  const int seq_len = 16;
  int spanning = 0;
  for (std::uint64_t g = 0; g < 1000; ++g) {
    const auto off = mapped.train_offset(7, g, seq_len);
    for (const auto end : ends) spanning += off < end && end < off + seq_len + 1;
  }
  EXPECT_GT(spanning, 10);  // windows across a file boundary (about 35 expected)
  const auto a = mapped.train_batch(7, 0, 1000, seq_len), b = in_memory.train_batch(7, 0, 1000, seq_len);
  EXPECT_TRUE(torch::equal(a.input, b.input));
  EXPECT_TRUE(torch::equal(a.target, b.target));
  EXPECT_TRUE(torch::equal(mapped.validation_batch(seq_len).input, in_memory.validation_batch(seq_len).input));
  EXPECT_TRUE(torch::equal(mapped.validation_batch(seq_len).target, in_memory.validation_batch(seq_len).target));

  // --val-text: all of the first text trains, the second gives the validation windows.
  const auto valid = pseudo_text(700, 99);
  write_bytes(dir / "valid.txt", valid);
  const auto split = text_corpus::read_text(dir / "texts", dir / "valid.txt");
  const text_corpus split_in_memory(all, valid);
  EXPECT_EQ(split.n_train(), all.size());
  EXPECT_EQ(split.n_valid(), valid.size());
  EXPECT_TRUE(torch::equal(split.train_batch(3, 5, 64, seq_len).input, split_in_memory.train_batch(3, 5, 64, seq_len).input));
  EXPECT_TRUE(torch::equal(split.validation_batch(seq_len).target, split_in_memory.validation_batch(seq_len).target));

  // A copy shares the mappings, which outlive the original.
  std::unique_ptr<text_corpus> original = std::make_unique<text_corpus>(text_corpus::read_text(dir / "texts"));
  const text_corpus copy = *original;
  original.reset();
  EXPECT_EQ(copy.bytes(), all);
  EXPECT_THROW(copy.bytes(all.size() + 1, 1).at(0), std::out_of_range);
}

// The point of mapping: a big text costs no heap. Reading the 64 MiB file into memory,
// as before, grew this process's anonymous memory by 64 MiB; mapping it and sampling
// from it grows it by the batches only.
TEST(Data, MappedTextCostsNoHeap) {
  troupe::test::temp_dir dir;
  const std::size_t n = std::size_t(64) << 20;
  {
    std::vector<std::uint8_t> text(n);
    for (std::size_t i = 0; i < n; ++i) text[i] = std::uint8_t('a' + i % 26);
    write_bytes(dir / "big.txt", text);
  }
  const auto before = anonymous_resident_bytes();
  ASSERT_GT(before, 0) << "no RssAnon in /proc/self/status";
  const auto corpus = text_corpus::read_text(dir / "big.txt");
  const auto b = corpus.train_batch(1, 0, 64, 1024);
  const auto v = corpus.validation_batch(1024);
  const auto grown = anonymous_resident_bytes() - before;
  EXPECT_EQ(corpus.size(), n);
  EXPECT_EQ(b.input[0][0].item<std::int64_t>(), 'a' + std::int64_t(corpus.train_offset(1, 0, 1024) % 26));
  EXPECT_LT(grown, std::int64_t(8) << 20) << "anonymous memory grew by " << grown << " bytes for a " << n
                                          << "-byte text";
}

// A file system that cannot map a text (mmap fails; forced here with
// text_corpus::fail_mappings_for_testing):
// the text is read into memory instead, with a warning, and gives the same samples.
TEST(Data, ATextThatCannotBeMappedIsReadIntoMemory) {
  troupe::test::temp_dir dir;
  std::filesystem::create_directories(dir.path / "texts");
  std::vector<std::uint8_t> all;
  for (std::size_t i = 0; i < 3; ++i) {
    const auto part = pseudo_text(std::size_t(1) << (12 + 6 * i), 77 * i);  // 4 KiB, 256 KiB, 16 MiB
    write_bytes(dir / ("texts/part-" + std::to_string(i)), part);
    all.insert(all.end(), part.begin(), part.end());
  }
  const auto mapped = text_corpus::read_text(dir / "texts");
  text_corpus::fail_mappings_for_testing(true);
  const auto before = anonymous_resident_bytes();
  const auto read = text_corpus::read_text(dir / "texts");
  const auto grown = anonymous_resident_bytes() - before;
  text_corpus::fail_mappings_for_testing(false);
  EXPECT_EQ(mapped.mapped_bytes(), all.size());
  EXPECT_EQ(read.mapped_bytes(), 0u);
  ASSERT_EQ(read.size(), all.size());
  EXPECT_EQ(read.bytes(), all);
  // (The kernel updates RssAnon in batches: 1.11 MB read showed as 1.00 MB grown.)
  EXPECT_GE(grown, std::int64_t(all.size()) / 2) << "the text is in this process's memory";
  const int seq_len = 64;
  EXPECT_TRUE(torch::equal(read.train_batch(5, 0, 256, seq_len).input, mapped.train_batch(5, 0, 256, seq_len).input));
  EXPECT_TRUE(torch::equal(read.validation_batch(seq_len).target, mapped.validation_batch(seq_len).target));
}

// data.text replaces the fortunes corpus for the gpt workloads, in training samples and
// in the fingerprint the hosts compare; a text too short for seq_len fails already there.
TEST(Data, TrainingDataReadsTheTextOfTheConfig) {
  troupe::test::temp_dir dir;
  std::string text;
  for (int i = 0; i < 200; ++i) text += "line " + std::to_string(i) + " of a text of one's own\n";
  std::ofstream(dir / "mine.txt") << text;
  job_config cfg;
  cfg.text = dir / "mine.txt";
  training_data data(cfg);
  const auto b = data.samples(3, 0, 2);
  const text_corpus corpus(std::vector<std::uint8_t>(text.begin(), text.end()));
  EXPECT_TRUE(torch::equal(b.input, corpus.train_batch(cfg.seed, 3 * cfg.global_batch, 2, 128).input));
  {  // a process holds one copy of a corpus while it is in use
    const training_data loader(cfg, training_data::use::training), evaluation(cfg, training_data::use::evaluation);
    EXPECT_EQ(loader.corpus(), data.corpus());
    EXPECT_EQ(evaluation.corpus(), data.corpus());
    job_config fortunes;
    EXPECT_NE(training_data(fortunes).corpus(), data.corpus());
  }
  const auto size = std::to_string(text.size()) + " bytes, ";
  EXPECT_EQ(training_data::fingerprint(cfg).substr(0, size.size()), size);
  cfg.seq_len = 1024;  // needs 10 x (1025 + 32) bytes or so
  EXPECT_THROW(training_data::fingerprint(cfg), data_error);
}

TEST(Data, FashionMnistLoadsAndEpochOrderIsAPermutation) {
  fashion_mnist data;
  EXPECT_EQ(data.train_size(), 60000);
  EXPECT_EQ(data.test_size(), 10000);
  const auto order = data.epoch_order(1234, 0);
  std::set<std::int64_t> seen(order.begin(), order.end());
  EXPECT_EQ(seen.size(), 60000u);
  EXPECT_EQ(*seen.begin(), 0);
  EXPECT_EQ(*seen.rbegin(), 59999);
  EXPECT_NE(order, data.epoch_order(1234, 1));
  const auto b = data.train_batch(order, 64, 16);
  EXPECT_EQ(b.input.sizes(), (std::vector<std::int64_t>{16, 784}));
  // Normalised with mean 0.2860, std 0.3530: the data set's mean is near 0.
  const auto test = data.test_set();
  EXPECT_NEAR(test.input.mean().item<double>(), 0.0, 0.05);
  EXPECT_EQ(test.target.max().item<std::int64_t>(), 9);
}

// Evaluations read only the test set, data loaders only the training set; the other
// part is not read and asking for it is an error, not an empty batch. A part loaded on
// its own equals that part of the whole.
TEST(Data, FashionMnistLoadsOnlyThePartItIsAskedFor) {
  const fashion_mnist whole, test_only(fashion_mnist::default_dir, false, true),
      train_only(fashion_mnist::default_dir, true, false);
  EXPECT_TRUE(torch::equal(test_only.test_set().input, whole.test_set().input));
  EXPECT_TRUE(torch::equal(test_only.test_set().target, whole.test_set().target));
  EXPECT_THROW(test_only.train_size(), data_error);
  EXPECT_THROW(test_only.epoch_order(1234, 0), data_error);
  const auto order = whole.epoch_order(1234, 0);
  EXPECT_EQ(train_only.epoch_order(1234, 0), order);
  EXPECT_TRUE(torch::equal(train_only.train_batch(order, 64, 16).input, whole.train_batch(order, 64, 16).input));
  EXPECT_THROW(train_only.test_set(), data_error);
  EXPECT_THROW(train_only.test_size(), data_error);
  // training_data: the coordinator's evaluation set, the data loaders' samples.
  job_config c;
  c.workload = "fmnist-mlp";
  EXPECT_TRUE(torch::equal(training_data(c, training_data::use::evaluation).evaluation_set().input,
                           whole.test_set().input));
  EXPECT_THROW(training_data(c, training_data::use::training).evaluation_set(), data_error);
  training_data loader(c, training_data::use::training), both(c);
  EXPECT_TRUE(torch::equal(loader.samples(3, 0, 8).input, both.samples(3, 0, 8).input));
}

TEST(Data, MissingFashionMnistNamesThePackage) {
  try {
    fashion_mnist data("/nonexistent");
    FAIL() << "no error for missing Fashion-MNIST";
  } catch (const data_error& e) {
    EXPECT_NE(std::string(e.what()).find("dataset-fashion-mnist"), std::string::npos) << e.what();
  }
}

}  // namespace troupe
