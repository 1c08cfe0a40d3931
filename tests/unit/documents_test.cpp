// tokenizer.json's BPE on small hand-written tokenizers (merge order, byte fallback,
// added tokens, the template), Megatron's indexed format written and read back, the
// documents of JSON lines and folders with their EOS, and the refusals of bad input.
// (The ids of real tokenizers against AutoTokenizer: tests/integration/tokenizer_client_test.cpp.)
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "compute/data/documents.hpp"
#include "compute/data/hf_tokenizer.hpp"
#include "compute/data/training_data.hpp"
#include "small_tokenizer.hpp"
#include "test_util.hpp"

namespace troupe {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

void write(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

}  // namespace

TEST(HfTokenizer, MergesApplyByRankAndRareCharactersFallBackToBytes) {
  test::temp_dir dir;
  write(dir / "tokenizer.json", test::small_bpe().dump());
  const hf_tokenizer tok(dir / "tokenizer.json");
  EXPECT_EQ(tok.size(), 13);
  // "b c" ranks first: a + bc, then "a bc" -> abc (not ab + c).
  EXPECT_EQ(tok.encode("abc"), (std::vector<int>{6}));
  EXPECT_EQ(tok.encode("ab"), (std::vector<int>{4}));
  // 'x' and '!' are byte pieces; 'y' has none: one unknown for the run (fuse_unk).
  EXPECT_EQ(tok.encode("ax!"), (std::vector<int>{1, 7, 8}));
  EXPECT_EQ(tok.encode("ayyb"), (std::vector<int>{1, 0, 2}));
  // Special tokens split the text; </s> takes the whitespace before it (lstrip).
  EXPECT_EQ(tok.encode("<s>abc  </s>c"), (std::vector<int>{11, 6, 12, 3}));
  const auto bytes = tok.piece_bytes();
  EXPECT_EQ(bytes[7], 1);   // <0x78>
  EXPECT_EQ(bytes[6], 3);   // abc
  EXPECT_EQ(bytes[10], 2);  // ▁a: the space and a
  EXPECT_EQ(bytes[11], 0);  // <s>
}

TEST(HfTokenizer, NormalizerTemplateAndConfigGiveLlamaTwosIds) {
  test::temp_dir dir;
  auto j = test::small_bpe();
  j["normalizer"] = {{"type", "Sequence"},
                     {"normalizers",
                      {{{"type", "Prepend"}, {"prepend", "\xe2\x96\x81"}},
                       {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "\xe2\x96\x81"}}}}};
  j["post_processor"] = {{"type", "TemplateProcessing"},
                         {"single", {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}}, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
                         {"pair", json::array()},
                         {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {11}}, {"tokens", {"<s>"}}}}}}};
  j["decoder"] = {{"type", "Sequence"},
                  {"decoders",
                   {{{"type", "Replace"}, {"pattern", {{"String", "\xe2\x96\x81"}}}, {"content", " "}},
                    {{"type", "ByteFallback"}},
                    {{"type", "Fuse"}},
                    {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}};
  write(dir / "tokenizer.json", j.dump());
  const hf_tokenizer tok(dir / "tokenizer.json");
  EXPECT_EQ(tok.encode("a b"), (std::vector<int>{11, 10, 9, 2}));  // <s> ▁a ▁ b
  EXPECT_EQ(tok.decode({10, 9, 2, 7}), "a bx");
  EXPECT_EQ(tok.eos_id(), -1);
  // tokenizer_config.json: add_eos_token set explicitly rebuilds the template.
  write(dir / "tokenizer_config.json", R"({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": false,
                                           "add_eos_token": true})");
  const hf_tokenizer with_config(dir / "tokenizer.json", tokenizer_config::read(dir / "tokenizer_config.json"));
  EXPECT_EQ(with_config.encode("a"), (std::vector<int>{10, 12}));
  EXPECT_EQ(with_config.eos_id(), 12);
  EXPECT_EQ(with_config.bos_id(), 11);
}

// A lone tokenizer.model as transformers 5's LlamaTokenizer converts it: merges from
// the splits of each piece (by the merged piece's id, then the left part's length),
// Metaspace's first-only prefix (always with legacy), control pieces special, a
// user-defined piece added, BOS only when tokenizer_config.json adds it.
TEST(HfTokenizer, ALlamaTokenizerModelIsTheBpeTransformersBuildsFromIt) {
  using kind = sentencepiece_piece::kind;
  const std::string sp = "\xe2\x96\x81";
  const std::vector<sentencepiece_piece> pieces = {
      {"<unk>", kind::unknown}, {"<s>", kind::control}, {"</s>", kind::control}, {"<0x21>", kind::byte},
      {sp, kind::normal},       {"a", kind::normal},    {"b", kind::normal},     {sp + "a", kind::normal},
      {"ab", kind::normal},     {sp + "ab", kind::normal}, {"<sep>", kind::user_defined}};
  tokenizer_config config;
  config.unk_token = "<unk>";
  config.bos_token = "<s>";
  config.eos_token = "</s>";
  const auto tok = hf_tokenizer::from_text(llama_tokenizer_json(pieces, config), "test", config);
  // ▁ab▁ab then '!' as its byte: (▁, a) first, (a, b), (▁, ab), (▁a, b) last.
  EXPECT_EQ(tok->encode("ab ab!"), (std::vector<int>{9, 9, 3}));
  EXPECT_EQ(tok->decode({9, 9, 3}), "ab ab!");
  EXPECT_EQ(tok->encode("a<sep>b"), (std::vector<int>{7, 10, 6}));  // only the text's start gets ▁
  config.legacy = 1;
  EXPECT_EQ(hf_tokenizer::from_text(llama_tokenizer_json(pieces, config), "test", config)->encode("a<sep>b"),
            (std::vector<int>{7, 10, 4, 6}));
  config.legacy = -1;
  config.add_bos_token = 1;
  const auto with_bos = hf_tokenizer::from_text(llama_tokenizer_json(pieces, config), "test", config);
  EXPECT_EQ(with_bos->encode("ab</s>"), (std::vector<int>{1, 9, 2}));
  EXPECT_EQ(with_bos->eos_id(), 2);
}

TEST(HfTokenizer, UnsupportedTokenizersAreNamed) {
  test::temp_dir dir;
  const auto refusal = [&](json j) {
    write(dir / "t.json", j.dump());
    try {
      hf_tokenizer tok(dir / "t.json");
    } catch (const data_error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  auto j = test::small_bpe();
  j["model"] = {{"type", "WordPiece"}, {"vocab", {{"a", 0}}}};
  EXPECT_NE(refusal(j).find("WordPiece"), std::string::npos) << refusal(j);
  j["model"] = {{"type", "Unigram"}, {"vocab", json::array()}};
  EXPECT_NE(refusal(j).find("Unigram"), std::string::npos) << refusal(j);
  j = test::small_bpe();
  j["normalizer"] = {{"type", "Precompiled"}, {"precompiled_charsmap", ""}};
  EXPECT_NE(refusal(j).find("Precompiled"), std::string::npos) << refusal(j);
  j = test::small_bpe();
  j["pre_tokenizer"] = {{"type", "BertPreTokenizer"}};
  EXPECT_NE(refusal(j).find("BertPreTokenizer"), std::string::npos) << refusal(j);
  EXPECT_NE(refusal(json::parse("{\"model\": 3}")).find("t.json"), std::string::npos);
  write(dir / "t.json", test::small_bpe().dump());
  EXPECT_THROW(hf_tokenizer(dir / "t.json").encode("a\xff"), data_error);  // not UTF-8
}

TEST(MegatronDataset, WrittenIndexReadsBackAndMismatchesAreRefused) {
  test::temp_dir dir;
  for (const int vocab : {1000, 100000}) {
    const std::string prefix = dir / ("d" + std::to_string(vocab));
    megatron_writer w(prefix, vocab);
    w.add_document({1, 2, 3});
    w.add_document({});
    w.add_document({vocab - 1, 0});
    w.finish();
    EXPECT_EQ(data_format_of(prefix), data_format::megatron);
    const auto index = read_megatron_index(prefix);
    EXPECT_EQ(index.dtype_code, vocab < 65500 ? 8 : 4);
    EXPECT_EQ(index.sequence_lengths, (std::vector<std::int32_t>{3, 0, 2}));
    EXPECT_EQ(index.document_indices, (std::vector<std::int64_t>{0, 1, 2, 3}));
    const auto tokens = data_tokens(prefix, "text", nullptr, -1, dir / "cache");
    ASSERT_EQ(tokens->size(), 5u);
    EXPECT_EQ((*tokens)[3], vocab - 1);
  }
  const std::string prefix = dir / "d1000";
  // A .bin that is not the index's: named with both sizes.
  fs::resize_file(prefix + ".bin", 8);
  try {
    read_megatron_index(prefix);
    ADD_FAILURE() << "a short .bin was read";
  } catch (const data_error& e) {
    EXPECT_NE(std::string(e.what()).find("holds 8 bytes"), std::string::npos) << e.what();
  }
  // An unknown dtype code (byte 17 of the header).
  {
    std::fstream f(prefix + ".idx", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(17);
    f.put(char(9));
  }
  try {
    read_megatron_index(prefix);
    ADD_FAILURE() << "dtype code 9 was read";
  } catch (const data_error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown dtype code 9"), std::string::npos) << e.what();
  }
  fs::remove(prefix + ".idx");
  EXPECT_THROW(data_format_of(prefix), data_error);  // a .bin without its .idx
}

TEST(Documents, JsonLinesFilesAndFoldersInOrderWithTheirEos) {
  test::temp_dir dir;
  write(dir / "spm.txt", "abcabc ab\nca\n");
  fs::create_directories(dir / "tok");
  write(dir / "tok/tokenizer.json", test::small_bpe().dump());
  write(dir / "tok/tokenizer_config.json", R"({"eos_token": "</s>"})");
  const tokenizer tok(dir / "tok");  // a folder's tokenizer
  const int eos = tok.eos_id();
  ASSERT_EQ(eos, 12);
  write(dir / "a.jsonl", "{\"text\": \"abc\"}\n\n   \n{\"text\": \"ca\", \"id\": 3}\n");
  fs::create_directories(dir / "folder");
  write(dir / "folder/b", "bc");
  write(dir / "folder/a", "ab");
  write(dir / "folder/.hidden", "zz");
  std::vector<std::string> texts;
  for (const auto& p : {dir / "a.jsonl", dir / "folder", dir / "spm.txt"})
    for_each_document(p, "text", [&](std::string&& t, const std::string&) { texts.push_back(t); });
  EXPECT_EQ(texts, (std::vector<std::string>{"abc", "ca", "ab", "bc", "abcabc ab\nca\n"}));
  std::vector<std::vector<int>> docs;
  encode_documents(dir / "a.jsonl", "text", tok, eos, 2, [&](const std::vector<int>& ids) { docs.push_back(ids); });
  ASSERT_EQ(docs.size(), 2u);
  auto expect = tok.encode("abc");
  expect.push_back(eos);
  EXPECT_EQ(docs[0], expect);
  // The cache holds the same stream, and is read (not written) again.
  bool written = false;
  const auto first = data_tokens(dir / "a.jsonl", "text", &tok, eos, dir / "cache", &written);
  EXPECT_TRUE(written);
  const auto again = data_tokens(dir / "a.jsonl", "text", &tok, eos, dir / "cache", &written);
  EXPECT_FALSE(written);
  ASSERT_EQ(again->size(), docs[0].size() + docs[1].size());
  EXPECT_EQ((*again)[docs[0].size() - 1], eos);
  // EOS is not doubled where a document already ends with it (the tokenizer's own).
  const int last_of_ca = docs[1][docs[1].size() - 2];
  std::vector<std::vector<int>> as_eos;
  encode_documents(dir / "a.jsonl", "text", tok, last_of_ca, 1, [&](const std::vector<int>& ids) { as_eos.push_back(ids); });
  EXPECT_EQ(as_eos[1].size(), docs[1].size() - 1);
}

TEST(Documents, BadLinesAreNamedWithFileAndLine) {
  test::temp_dir dir;
  const auto error_of = [&](const std::string& body, const std::string& field = "text") {
    write(dir / "bad.jsonl", body);
    try {
      for_each_document(dir / "bad.jsonl", field, [](std::string&&, const std::string&) {});
    } catch (const data_error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_NE(error_of("{\"text\": \"a\"}\n{\"text\": \"b\"\n").find("bad.jsonl:2: not a JSON line"), std::string::npos);
  EXPECT_NE(error_of("{\"text\": \"a\"}\n\n{\"body\": \"b\"}\n").find("bad.jsonl:3: no field 'text'"), std::string::npos);
  EXPECT_NE(error_of("{\"text\": 5}\n").find("field 'text' is not a string"), std::string::npos);
  EXPECT_EQ(error_of("{\"body\": \"b\"}\n", "body"), "accepted");
}

TEST(Documents, JobsWithoutTokenizerOrEosOrWithTooLargeATokenizerAreRefused) {
  test::temp_dir dir;
  write(dir / "a.jsonl", "{\"text\": \"abc\"}\n");
  auto c = test::gpt_config(1);
  c.workload = "llama-tiny";
  c.data = {dir / "a.jsonl"};
  EXPECT_NE(test::config_error_of(c).find("documents need a tokenizer"), std::string::npos) << test::config_error_of(c);
  c.text = dir / "a.jsonl";
  c.tokenizer = "";
  EXPECT_NE(test::config_error_of(c).find("not both"), std::string::npos) << test::config_error_of(c);
  c.text = "";
  c.data = {dir / "missing.jsonl"};
  EXPECT_NE(test::config_error_of(c).find("does not exist"), std::string::npos) << test::config_error_of(c);
  // A tokenizer.json without an EOS token.
  write(dir / "tokenizer.json", test::small_bpe().dump());
  c.data = {dir / "a.jsonl"};
  c.tokenizer = dir / "tokenizer.json";
  EXPECT_NE(test::config_error_of(c).find("has no EOS token"), std::string::npos) << test::config_error_of(c);
  write(dir / "tokenizer_config.json", R"({"eos_token": "</s>"})");
  c.tokenizer = dir.path.string();  // the folder: its tokenizer.json and tokenizer_config.json
  EXPECT_EQ(test::config_error_of(c), "");
  c.vocab = 12;  // the tokenizer has 13 ids
  EXPECT_NE(test::config_error_of(c).find("vocab 12 is below the tokenizer's 13 pieces"), std::string::npos)
      << test::config_error_of(c);
  auto v = test::gpt_config(1);
  v.val_data = {dir / "a.jsonl"};
  EXPECT_NE(test::config_error_of(v).find("give the training documents too"), std::string::npos);
}

}  // namespace troupe
