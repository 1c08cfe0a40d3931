#pragma once
// A Hugging Face tokenizer as `tokenizers` and transformers' AutoTokenizer encode it: a
// tokenizer.json with a BPE model (byte-level as GPT-2, Llama 3 and Qwen; or
// SentencePiece-style with byte fallback as Llama 2's and Mistral's fast tokenizers), its
// added and special tokens, normalizer, pre-tokenizer (regexes over PCRE2 with Unicode
// properties), post-processor and decoder, and tokenizer_config.json's settings.
//
// No Debian package reads tokenizer.json, so this is Troupe's own: its ids are checked
// against `tokenizers` and AutoTokenizer (tests/integration/tokenizer_client_test.cpp).
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace troupe {

/// A token of the added vocabulary (tokenizer.json's added_tokens, tokenizer_config.json's
/// added_tokens_decoder): matched in the text before the model sees it.
struct added_token {
  int id = 0;
  std::string content;
  bool single_word = false, lstrip = false, rstrip = false, normalized = false, special = false;
};

/// Splits text at added tokens as `tokenizers` does: the leftmost, then longest, match;
/// lstrip/rstrip take the whitespace beside it; single_word only at word boundaries.
class added_vocabulary {
 public:
  added_vocabulary() = default;
  explicit added_vocabulary(std::vector<added_token> tokens);
  bool empty() const { return tokens_.empty(); }
  const std::vector<added_token>& tokens() const { return tokens_; }
  /// A piece of the split: text (`id` < 0) or an added token's id. `begin` is its offset in
  /// the text given.
  struct piece {
    std::string_view text;
    int id = -1;
    std::size_t begin = 0;
  };
  /// The pieces of `text`, with the tokens whose `normalized` equals `normalized` only.
  std::vector<piece> split(std::string_view text, bool normalized) const;

 private:
  std::vector<added_token> tokens_;
  std::vector<std::size_t> by_first_[256];  ///< tokens_ by their first byte
};

/// What tokenizer_config.json sets that changes a folder's ids (transformers' tokenizer
/// classes read it beside tokenizer.json or tokenizer.model).
struct tokenizer_config {
  std::string tokenizer_class;            ///< "" : not set
  std::string bos_token, eos_token, unk_token;  ///< a token's text ("" : not set)
  int add_bos_token = -1, add_eos_token = -1;   ///< as set: 0 or 1 (-1: not set)
  int legacy = -1, add_prefix_space = -1;       ///< LlamaTokenizer's (a lone tokenizer.model): 0, 1 or -1
  std::vector<added_token> added_tokens;  ///< added_tokens_decoder
  /// LlamaTokenizer and CodeLlamaTokenizer (fast or not): BOS by default.
  bool llama_class() const;
  /// Reads `path` ("": nothing set). Throws data_error naming the file.
  static tokenizer_config read(const std::string& path);
};

class hf_tokenizer {
 public:
  /// `json`: a tokenizer.json; `config`: its tokenizer_config.json's settings. Throws
  /// data_error naming the file and what is not supported (a WordPiece or Unigram model,
  /// an unknown normalizer, ...).
  hf_tokenizer(const std::string& json, const tokenizer_config& config = {});
  /// The same from a tokenizer.json's text built in memory (`where` names it in errors).
  static std::unique_ptr<hf_tokenizer> from_text(const std::string& json_text, const std::string& where,
                                                 const tokenizer_config& config = {});
  ~hf_tokenizer();
  hf_tokenizer(const hf_tokenizer&) = delete;
  hf_tokenizer& operator=(const hf_tokenizer&) = delete;

  /// Ids in the vocabulary: the largest id (model's or added) + 1.
  int size() const;
  /// AutoTokenizer's `tok(text)["input_ids"]`: the special tokens of the post-processor
  /// (or tokenizer_config's add_bos_token / add_eos_token) included. Thread-safe. Throws
  /// data_error for text that is not UTF-8.
  std::vector<int> encode(std::string_view text) const;
  /// The text of `ids` (special tokens included), through the tokenizer's decoder.
  std::string decode(const std::vector<int>& ids) const;
  /// Bytes each id stands for: a byte-level piece its characters, a byte piece <0xNN> 1,
  /// another piece its UTF-8 bytes with each U+2581 counted as 1, a special token 0.
  std::vector<std::int32_t> piece_bytes() const;
  /// tokenizer_config.json's eos_token / bos_token ids (-1: none).
  int eos_id() const;
  int bos_id() const;
  /// "byte-level BPE" or "BPE with byte fallback", for logs.
  std::string describe() const;

  struct impl;

 private:
  struct text_tag {};
  hf_tokenizer(text_tag, const std::string& where, const std::string& text, const tokenizer_config& config);
  std::unique_ptr<impl> impl_;
};

/// A SentencePiece model's piece, for llama_tokenizer_json.
struct sentencepiece_piece {
  std::string text;
  enum class kind { normal, control, byte, unknown, user_defined } type = kind::normal;
};

/// The tokenizer.json that transformers 5's LlamaTokenizer builds from a folder's lone
/// tokenizer.model (its `pieces`, by id) and tokenizer_config.json (`config`): a BPE of
/// every piece with byte fallback, merges of every split of a piece into two pieces
/// (ranked by the merged piece's id, then the left part's length), no normalizer,
/// Metaspace (prepend_scheme first; always when `legacy`, never without
/// add_prefix_space), config's unk, bos and eos tokens (as named: a folder's default to
/// <unk>, <s>, </s>) and the control pieces as special tokens, the user-defined pieces as
/// added ones. (BOS and EOS come from add_bos_token and
/// add_eos_token, by default neither.)
std::string llama_tokenizer_json(const std::vector<sentencepiece_piece>& pieces, const tokenizer_config& config);

/// True when `text` is valid UTF-8; else `bad` is the offset of the first invalid byte.
bool valid_utf8(std::string_view text, std::size_t* bad = nullptr);

}  // namespace troupe
