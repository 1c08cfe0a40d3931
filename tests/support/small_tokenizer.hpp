#pragma once
// A tokenizer.json small enough to write by hand, for the tests of documents.
#include <nlohmann/json.hpp>

namespace troupe::test {

/// A tokenizer.json of a BPE over characters: a, b, c, ab, bc, abc, the byte pieces
/// of 'x' and '!', <s> and </s>; the merges' order decides "abc".
inline nlohmann::json small_bpe() {
  nlohmann::json vocab = {{"<unk>", 0},    {"a", 1},    {"b", 2},    {"c", 3},
                          {"ab", 4},       {"bc", 5},   {"abc", 6},  {"<0x78>", 7},
                          {"<0x21>", 8},   {"\xe2\x96\x81", 9}, {"\xe2\x96\x81" "a", 10}};
  return {{"version", "1.0"},
          {"added_tokens",
           {{{"id", 11}, {"content", "<s>"}, {"special", true}, {"normalized", false}},
            {{"id", 12}, {"content", "</s>"}, {"special", true}, {"normalized", false}, {"lstrip", true}}}},
          {"normalizer", nullptr},
          {"pre_tokenizer", nullptr},
          {"post_processor", nullptr},
          {"decoder", nullptr},
          {"model",
           {{"type", "BPE"},
            {"vocab", vocab},
            {"merges", {"b c", "a b", "a bc", "\xe2\x96\x81 a"}},
            {"unk_token", "<unk>"},
            {"fuse_unk", true},
            {"byte_fallback", true}}}};
}

}  // namespace troupe::test
