// The real clients of WORKLOADS.md section 6's data: tokenizer folders trained with
// `tokenizers` and saved by transformers (tests/support/python/tokenizer_folders.py) give
// AutoTokenizer's ids, id for id, through Troupe's tokenizer.json and tokenizer.model
// readers; Megatron-Core's IndexedDatasetBuilder writes datasets Troupe reads to the same
// tokens, and Megatron-Core's IndexedDataset reads `troupe preprocess`'s; 5 steps on JSON
// lines and on a Megatron dataset follow a plain PyTorch loop over the transformers module
// within 1e-5. The clients are those of tests/support/hf_python.hpp; without Python's
// package registry the tests are skipped.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "compute/checkpoint/hf_folder.hpp"
#include "compute/data/documents.hpp"
#include "compute/trainer/local_trainer.hpp"
#include "actors/tp_groups.hpp"
#include "hf_python.hpp"
#include "test_util.hpp"

namespace troupe {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

std::string scripts() { return std::string(troupe::test::source_dir) + "/tests/support/python/"; }

json read_json(const std::string& path) {
  std::ifstream in(path);
  return json::parse(in);
}

/// Each folder of `kinds` that tokenizer_folders.py writes with transformers `major`:
/// Troupe's ids equal AutoTokenizer's for every text, its EOS is AutoTokenizer's, and a
/// byte-level tokenizer decodes its ids back to the text.
void expect_autotokenizer_ids(int major, const std::vector<std::string>& kinds) {
  if (hf_python(major).empty()) GTEST_SKIP() << "no transformers " << major << ": skipped";
  test::temp_dir dir;
  std::string cmd = hf_python(major) + " " + scripts() + "tokenizer_folders.py " + dir.path.string();
  for (const auto& k : kinds) cmd += " " + k;
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  for (const auto& kind : kinds) {
    const auto expected = read_json(dir / (kind + ".json"));
    const tokenizer tok(dir / kind);
    const auto& texts = expected.at("texts");
    // (A lone tokenizer.model too: transformers 5 converts it to a BPE, and so does Troupe.)
    const auto& ids = expected.at("ids");
    int same = 0, compared = 0;
    for (std::size_t i = 0; i < texts.size(); ++i) {
      const auto text = texts[i].get<std::string>();
      ++compared;
      const auto want = ids[i].get<std::vector<int>>();
      const auto got = tok.encode(text);
      EXPECT_EQ(got, want) << kind << " (" << expected.at("class") << ", transformers " << expected.at("transformers")
                           << ") text " << i << ": " << text;
      same += got == want;
    }
    EXPECT_EQ(same, compared) << kind;
    if (!expected.at("eos").is_null()) EXPECT_EQ(tok.eos_id(), expected.at("eos").get<int>()) << kind;
    if (kind == "gpt2" || kind == "qwen2")
      for (const auto& t : texts) {
        const auto text = t.get<std::string>();
        if (kind == "qwen2" && text.find("\xcc\x81") != std::string::npos) continue;  // NFC changes it
        EXPECT_EQ(tok.decode(tok.encode(text)), text) << kind;
      }
  }
}

}  // namespace

TEST(TokenizerClient, TokenizerJsonAndModelGiveAutoTokenizersIds) {
  expect_autotokenizer_ids(5, {"gpt2", "llama3", "qwen2", "llama2", "metaspace", "spm"});
}

TEST(TokenizerClient, TokenizerJsonGivesTransformers4AutoTokenizersIds) {
  expect_autotokenizer_ids(4, {"gpt2", "llama3", "qwen2", "llama2", "metaspace"});
}

TEST(TokenizerClient, MegatronCoreDatasetsReadBothWays) {
  if (hf_python(5).empty()) GTEST_SKIP() << "no Megatron-Core (Python's package registry unreachable): skipped";
  test::temp_dir dir;
  const std::string py = hf_python(5) + " " + scripts() + "megatron_data.py ";
  // Megatron-Core's builder: Troupe reads the same stream, in both dtypes.
  for (const std::string dtype : {"uint16", "int32"}) {
    const std::string prefix = dir / dtype;
    const std::string cmd = py + "write " + prefix + " " + dtype;
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
    const auto stream = read_json(prefix + ".json").get<std::vector<std::int64_t>>();
    const auto tokens = data_tokens(prefix, "text", nullptr, -1, dir / "cache");
    ASSERT_EQ(tokens->size(), stream.size()) << dtype;
    std::vector<std::int64_t> got(stream.size());
    for (std::size_t i = 0; i < got.size(); ++i) got[i] = (*tokens)[i];
    EXPECT_EQ(got, stream) << dtype;
  }
  // `troupe preprocess`: Megatron-Core reads the documents AutoTokenizer encodes, EOS last.
  const std::string folders = hf_python(5) + " " + scripts() + "tokenizer_folders.py " + dir.path.string() + " llama3";
  ASSERT_EQ(std::system(folders.c_str()), 0) << folders;
  const auto expected = read_json(dir / "llama3.json");
  {
    std::ofstream out(dir / "docs.jsonl");
    for (const auto& t : expected.at("texts")) out << json{{"text", t}}.dump() << "\n";
  }
  const std::string pre = std::string(troupe::test::troupe_binary) + " preprocess --data " + (dir / "docs.jsonl") +
                          " --model " + (dir / "llama3") + " --out " + (dir / "pre") + " --threads 2";
  ASSERT_EQ(std::system(pre.c_str()), 0) << pre;
  const std::string read = py + "read " + (dir / "pre") + " " + (dir / "pre-read.json");
  ASSERT_EQ(std::system(read.c_str()), 0) << read;
  const auto got = read_json(dir / "pre-read.json");
  EXPECT_EQ(got.at("dtype"), "uint16");
  const int eos = tokenizer(dir / "llama3").eos_id();
  ASSERT_EQ(got.at("documents").size(), expected.at("ids").size());
  for (std::size_t i = 0; i < got.at("documents").size(); ++i) {
    auto want = expected.at("ids")[i].get<std::vector<int>>();
    if (want.empty() || want.back() != eos) want.push_back(eos);
    EXPECT_EQ(got.at("documents")[i].get<std::vector<int>>(), want) << "document " << i;
  }
}

namespace {

/// A llama3 folder of transformers 5 (hf_families.py) with a byte-level BPE tokenizer
/// of its 300 ids, and documents: the fortunes corpus's first 300 fortunes and the texts
/// of tokenizer_folders.py as JSON lines, and as `troupe preprocess` writes them.
struct document_folder {
  test::temp_dir dir;
  std::string folder, jsonl, megatron;
  explicit document_folder(const std::string& py) {
    const std::string made = py + "hf_families.py " + dir.path.string() + " llama3";
    EXPECT_EQ(std::system(made.c_str()), 0) << made;
    const std::string tok = py + "tokenizer_folders.py " + (dir / "tok") + " --vocab=300 llama3";
    EXPECT_EQ(std::system(tok.c_str()), 0) << tok;
    folder = dir / "llama3";
    for (const auto* f : {"tokenizer.json", "tokenizer_config.json"})
      fs::copy_file(dir / (std::string("tok/llama3/") + f), fs::path(folder) / f, fs::copy_options::overwrite_existing);
    jsonl = dir / "docs.jsonl";
    std::ofstream out(jsonl);
    const auto expected = read_json(dir / "tok/llama3.json");
    for (const auto& t : expected.at("texts")) out << json{{"text", t}}.dump() << "\n";
    std::ifstream fortunes("/usr/share/games/fortunes/fortunes");
    std::string line, doc;
    for (int n = 0; n < 300 && std::getline(fortunes, line);)
      if (line == "%") {
        out << json{{"text", doc}}.dump() << "\n";
        doc.clear();
        ++n;
      } else {
        doc += line + "\n";
      }
    out.close();
    megatron = dir / "docs";
    const std::string pre = std::string(troupe::test::troupe_binary) + " preprocess --data " + jsonl + " --model " +
                            folder + " --out " + megatron;
    EXPECT_EQ(std::system(pre.c_str()), 0) << pre;
  }
};

/// 5 steps of Troupe's local loop in the layout `layout` sets on `data`, and of
/// hf_train_reference.py over the same documents (with its --document-attention when the
/// layout sets it): losses and parameters within 1e-5.
void expect_documents_train_as_transformers(const document_folder& d, const std::string& data,
                                            const std::function<void(job_config&)>& layout) {
  constexpr int steps = 5, total = 200;
  auto c = test::gpt_config(total);
  c.runtime = "local";
  c.hf_model = d.folder;
  c.seq_len = 24;
  c.data = {data};
  c.cache_dir = d.dir / "cache";
  c.take_model_from_folder();
  layout(c);
  c.validate();
  test::temp_dir out;
  const std::string ref = hf_python(5) + " " + scripts() + "hf_train_reference.py " + d.folder + " " +
                          out.path.string() + " " + std::to_string(steps) + " " + std::to_string(total) + " 24 " +
                          (c.document_attention ? "--document-attention " : "") + data;
  ASSERT_EQ(std::system(ref.c_str()), 0) << ref;
  std::vector<double> expected;
  std::ifstream in(out / "losses.txt");
  for (double x; in >> x;) expected.push_back(x);
  ASSERT_EQ(expected.size(), std::size_t(steps));
  local_trainer t(c, std::nullopt, in_process_groups);
  for (int i = 0; i < steps; ++i) EXPECT_NEAR(t.step().loss, expected[i], 1e-5) << data << " step " << i;
  EXPECT_LE(test::max_abs_diff(t.state(), read_hf_folder(out / "final", c.model())), 1e-5) << data;
}

}  // namespace

TEST(TokenizerClient, JsonLinesAndMegatronDocumentsTrainAsTransformers) {
  if (hf_python(5).empty()) GTEST_SKIP() << "no transformers 5 (Python's package registry unreachable): skipped";
  const document_folder d(hf_python(5) + " " + scripts());
  expect_documents_train_as_transformers(d, d.jsonl, [](job_config& c) {
    c.tensor_parallel = 2;
    c.pipeline = 2;
  });
  expect_documents_train_as_transformers(d, d.megatron, [](job_config& c) { c.data_parallel = 2; });
  // Attention within documents: the reference runs each document of a window alone.
  expect_documents_train_as_transformers(d, d.jsonl, [](job_config& c) {
    c.document_attention = true;
    c.tensor_parallel = 2;
    c.sequence_parallel = true;
    c.pipeline = 2;
  });
}

}  // namespace troupe
