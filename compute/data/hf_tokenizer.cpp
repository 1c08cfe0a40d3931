#include "compute/data/hf_tokenizer.hpp"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <unicode/normalizer2.h>
#include <unicode/locid.h>
#include <unicode/unistr.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <mutex>
#include <queue>
#include <set>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "compute/data/data.hpp"
#include "compute/runtime/file_bytes.hpp"

namespace troupe {

using json = nlohmann::json;

bool valid_utf8(std::string_view s, std::size_t* bad) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const std::size_t n = s.size();
  for (std::size_t i = 0; i < n;) {
    const unsigned c = p[i];
    std::size_t len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    bool ok = len > 0 && i + len <= n;
    for (std::size_t k = 1; ok && k < len; ++k) ok = (p[i + k] & 0xC0) == 0x80;
    if (ok && len > 1) {  // overlong forms, surrogates and code points past U+10FFFF
      std::uint32_t cp = c & (0xFF >> (len + 1));
      for (std::size_t k = 1; k < len; ++k) cp = (cp << 6) | (p[i + k] & 0x3F);
      ok = (len == 2 && cp >= 0x80) || (len == 3 && cp >= 0x800 && (cp < 0xD800 || cp > 0xDFFF)) ||
           (len == 4 && cp >= 0x10000 && cp <= 0x10FFFF);
    }
    if (!ok) {
      if (bad) *bad = i;
      return false;
    }
    i += len;
  }
  return true;
}

namespace {

/// A number no other object of this process has had: what thread-local caches are keyed
/// by (an address may be reused by the next object once one is gone).
std::uint64_t next_serial() {
  static std::atomic<std::uint64_t> n{0};
  return ++n;
}

/// Length of the UTF-8 character that starts with byte `c`.
std::size_t utf8_len(unsigned char c) { return c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : 4; }

std::string utf8_of(std::uint32_t cp) {
  std::string out;
  if (cp < 0x80) {
    out += char(cp);
  } else if (cp < 0x800) {
    out += char(0xC0 | (cp >> 6));
    out += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += char(0xE0 | (cp >> 12));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  } else {
    out += char(0xF0 | (cp >> 18));
    out += char(0x80 | ((cp >> 12) & 0x3F));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  }
  return out;
}

/// GPT-2's map of the 256 byte values onto printable characters (byte-level BPE).
struct byte_alphabet {
  std::string to_char[256];
  std::unordered_map<std::string, unsigned char> to_byte;
  byte_alphabet() {
    int next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      to_char[b] = utf8_of(printable ? std::uint32_t(b) : std::uint32_t(next++));
      to_byte[to_char[b]] = static_cast<unsigned char>(b);
    }
  }
};
const byte_alphabet& alphabet() {
  static const byte_alphabet a;
  return a;
}

const std::string metaspace = "\xe2\x96\x81";  // U+2581

/// A compiled PCRE2 pattern (UTF, Unicode properties), matched with its JIT when there is one.
class regex {
 public:
  regex(const std::string& pattern, bool literal, const std::string& where) {
    int err = 0;
    PCRE2_SIZE at = 0;
    const std::uint32_t options = literal ? PCRE2_LITERAL | PCRE2_UTF : PCRE2_UTF | PCRE2_UCP;
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), options, &err, &at, nullptr);
    if (!code_) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof msg);
      throw data_error(where + ": the pattern " + pattern + " does not compile (" + reinterpret_cast<char*>(msg) +
                       " at " + std::to_string(at) + ")");
    }
    jit_ = pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE) == 0;
  }
  ~regex() { pcre2_code_free(code_); }
  regex(const regex&) = delete;
  regex& operator=(const regex&) = delete;

  /// The [begin, end) of every non-empty match of `s`, left to right.
  void matches(std::string_view s, std::vector<std::pair<std::size_t, std::size_t>>& out) const {
    // (A pattern's match data, per thread: kept for the thread's life, a few bytes each.)
    thread_local std::unordered_map<std::uint64_t, pcre2_match_data*> data;
    auto& md = data[serial_];
    if (!md) md = pcre2_match_data_create_from_pattern(code_, nullptr);
    out.clear();
    std::size_t at = 0;
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(s.data());
    while (at < s.size()) {
      // The text was checked as UTF-8 once (encode): no check per match.
      const int rc = jit_ ? pcre2_jit_match(code_, subject, s.size(), at, PCRE2_NO_UTF_CHECK, md, nullptr)
                          : pcre2_match(code_, subject, s.size(), at, PCRE2_NO_UTF_CHECK, md, nullptr);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) throw data_error("a pre-tokenizer's pattern failed to match (PCRE2 error " + std::to_string(rc) + ")");
      const auto* ov = pcre2_get_ovector_pointer(md);
      const std::size_t b = ov[0], e = ov[1];
      if (e > b) {
        out.emplace_back(b, e);
        at = e;
      } else {  // an empty match: on to the next character
        at = b + utf8_len(static_cast<unsigned char>(s[b]));
      }
    }
  }

 private:
  pcre2_code* code_ = nullptr;
  bool jit_ = false;
  std::uint64_t serial_ = next_serial();
};

/// A piece of pre-tokenized text, and whether it starts where the input does (Metaspace's
/// prepend_scheme "first").
struct piece {
  std::string text;
  bool first = false;
};

enum class split_behavior { removed, isolated, merged_with_previous, merged_with_next, contiguous };

split_behavior parse_behavior(const std::string& b, const std::string& where) {
  if (b == "Removed") return split_behavior::removed;
  if (b == "Isolated") return split_behavior::isolated;
  if (b == "MergedWithPrevious") return split_behavior::merged_with_previous;
  if (b == "MergedWithNext") return split_behavior::merged_with_next;
  if (b == "Contiguous") return split_behavior::contiguous;
  throw data_error(where + ": split behavior " + b + " is not one `tokenizers` has");
}

/// `tokenizers`' NormalizedString::split: the text cut at the regex's matches (or, inverted,
/// at what lies between them) with the matches kept as `behavior` says; empty parts dropped.
void split_piece(const piece& p, const regex& re, split_behavior behavior, bool invert, std::vector<piece>& out) {
  std::vector<std::pair<std::size_t, std::size_t>> m;
  re.matches(p.text, m);
  // Alternating (part, is_delimiter) over the text.
  std::vector<std::pair<std::pair<std::size_t, std::size_t>, bool>> parts;
  std::size_t at = 0;
  for (const auto& [b, e] : m) {
    if (b > at) parts.push_back({{at, b}, invert});
    parts.push_back({{b, e}, !invert});
    at = e;
  }
  if (at < p.text.size()) parts.push_back({{at, p.text.size()}, invert});
  // As `tokenizers` folds them: a delimiter not after (before, for MergedWithNext)
  // another joins its neighbour.
  std::vector<std::pair<std::size_t, std::size_t>> kept;
  bool previous = false;
  if (behavior == split_behavior::merged_with_next) {
    for (std::size_t k = parts.size(); k-- > 0;) {
      const auto [range, delim] = parts[k];
      if (delim && !previous && !kept.empty())
        kept.back().first = range.first;
      else
        kept.push_back(range);
      previous = delim;
    }
    std::reverse(kept.begin(), kept.end());
  } else {
    for (const auto& [range, delim] : parts) {
      const bool join = behavior == split_behavior::merged_with_previous ? delim && !previous
                        : behavior == split_behavior::contiguous         ? delim && previous
                                                                         : false;
      if (behavior == split_behavior::removed && delim) {
        // dropped
      } else if (join && !kept.empty()) {
        kept.back().second = range.second;
      } else {
        kept.push_back(range);
      }
      previous = delim;
    }
  }
  for (const auto& [b, e] : kept)
    if (e > b) out.push_back({p.text.substr(b, e - b), p.first && b == 0});
}

void replace_all(std::string& s, const std::string& from, const std::string& to) {
  if (from.empty()) return;
  std::string out;
  std::size_t at = 0;
  for (std::size_t pos; (pos = s.find(from, at)) != std::string::npos; at = pos + from.size()) {
    out.append(s, at, pos - at);
    out += to;
  }
  out.append(s, at, std::string::npos);
  s.swap(out);
}

/// The string of a {"String": s} or {"Regex": r} pattern, and which it is.
std::pair<std::string, bool> pattern_of(const json& p, const std::string& where) {
  if (p.contains("String")) return {p.at("String").get<std::string>(), true};
  if (p.contains("Regex")) return {p.at("Regex").get<std::string>(), false};
  throw data_error(where + ": a pattern that is neither String nor Regex");
}

/// Metaspace's prepend_scheme (older files: add_prefix_space), checked.
std::string prepend_scheme(const json& m, const std::string& where) {
  std::string scheme = m.value("prepend_scheme", "");
  if (scheme.empty()) scheme = m.value("add_prefix_space", true) ? "always" : "never";
  if (scheme != "always" && scheme != "first" && scheme != "never")
    throw data_error(where + ": Metaspace prepend_scheme " + scheme + " (expected always, first or never)");
  return scheme;
}

/// A byte piece "<0xNN>" of byte fallback.
bool is_byte_piece(const std::string& t) { return t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>'; }

bool is_space(unsigned char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

}  // namespace

// ---------------------------------------------------------------------------------------
// Added tokens

added_vocabulary::added_vocabulary(std::vector<added_token> tokens) : tokens_(std::move(tokens)) {
  // Longest first, so that the first token matching at a position is the longest.
  std::stable_sort(tokens_.begin(), tokens_.end(),
                   [](const added_token& a, const added_token& b) { return a.content.size() > b.content.size(); });
  for (std::size_t k = 0; k < tokens_.size(); ++k)
    if (!tokens_[k].content.empty()) by_first_[static_cast<unsigned char>(tokens_[k].content[0])].push_back(k);
}

namespace {
bool word_char(std::string_view s, std::size_t i) {
  const auto c = static_cast<unsigned char>(s[i]);
  return c >= 0x80 || std::isalnum(c) || c == '_';
}
}  // namespace

std::vector<added_vocabulary::piece> added_vocabulary::split(std::string_view text, bool normalized) const {
  std::vector<piece> out;
  std::size_t text_begin = 0;  // start of the text not yet emitted
  std::size_t i = 0;
  while (i < text.size()) {
    const added_token* hit = nullptr;
    for (const std::size_t k : by_first_[static_cast<unsigned char>(text[i])]) {
      const auto& t = tokens_[k];
      if (t.normalized != normalized || t.content.empty()) continue;
      if (text.compare(i, t.content.size(), t.content) != 0) continue;
      if (t.single_word) {
        const std::size_t e = i + t.content.size();
        if ((i > 0 && word_char(text, i - 1)) || (e < text.size() && word_char(text, e))) continue;
      }
      hit = &t;
      break;
    }
    if (!hit) {
      ++i;
      continue;
    }
    std::size_t b = i, e = i + hit->content.size();
    if (hit->lstrip)
      while (b > text_begin && is_space(static_cast<unsigned char>(text[b - 1]))) --b;
    if (hit->rstrip)
      while (e < text.size() && is_space(static_cast<unsigned char>(text[e]))) ++e;
    if (b > text_begin) out.push_back({text.substr(text_begin, b - text_begin), -1, text_begin});
    out.push_back({text.substr(b, e - b), hit->id, b});
    text_begin = i = e;
  }
  if (text_begin < text.size()) out.push_back({text.substr(text_begin), -1, text_begin});
  return out;
}

// ---------------------------------------------------------------------------------------
// tokenizer.json

struct hf_tokenizer::impl {
  std::string where;  // the file, for errors
  // model
  std::unordered_map<std::string, int> vocab;
  std::vector<std::string> id_to_token;
  struct pair_hash {
    std::size_t operator()(std::uint64_t x) const { return std::hash<std::uint64_t>()(x); }
  };
  std::unordered_map<std::uint64_t, std::pair<int, int>, pair_hash> merges;  // (a, b) -> (rank, merged id)
  int unk = -1;
  bool fuse_unk = false, byte_fallback = false, ignore_merges = false;
  int byte_ids[256];
  bool byte_level = false;  // a ByteLevel pre-tokenizer maps bytes to characters
  // pipeline
  added_vocabulary added;
  std::vector<bool> special;  // by id
  std::vector<std::function<void(std::string&)>> normalizers;
  std::vector<std::function<void(std::vector<piece>&)>> pre_tokenizers;
  std::vector<std::unique_ptr<regex>> regexes;  // the patterns the steps use
  std::vector<int> prefix_ids, suffix_ids;        // the post-processor's single template
  std::vector<std::function<void(std::vector<std::string>&)>> decoders;
  int eos = -1, bos = -1;
  std::uint64_t serial = next_serial();  ///< the word cache's key

  void parse_normalizer(const json& n);
  void parse_pre_tokenizer(const json& p);
  void parse_decoder(const json& d);
  void parse_post_processor(const json& p);
  int id_of(const std::string& token) const {
    const auto it = vocab.find(token);
    return it == vocab.end() ? -1 : it->second;
  }
  void bpe(const std::string& word, std::vector<int>& out) const;
  void encode_segment(std::string_view text, bool first, std::vector<int>& out) const;
};

void hf_tokenizer::impl::parse_normalizer(const json& n) {
  if (n.is_null()) return;
  const auto type = n.at("type").get<std::string>();
  if (type == "Sequence") {
    for (const auto& x : n.at("normalizers")) parse_normalizer(x);
  } else if (type == "Prepend") {
    const auto text = n.at("prepend").get<std::string>();
    normalizers.push_back([text](std::string& s) {
      if (!s.empty()) s.insert(0, text);
    });
  } else if (type == "Replace") {
    const auto [pattern, literal] = pattern_of(n.at("pattern"), where);
    const auto content = n.at("content").get<std::string>();
    if (literal) {
      normalizers.push_back([pattern = pattern, content](std::string& s) { replace_all(s, pattern, content); });
    } else {
      regexes.push_back(std::make_unique<regex>(pattern, false, where));
      const regex* re = regexes.back().get();
      normalizers.push_back([re, content](std::string& s) {
        std::vector<std::pair<std::size_t, std::size_t>> m;
        re->matches(s, m);
        std::string out;
        std::size_t at = 0;
        for (const auto& [b, e] : m) {
          out.append(s, at, b - at);
          out += content;
          at = e;
        }
        out.append(s, at, std::string::npos);
        s.swap(out);
      });
    }
  } else if (type == "NFC" || type == "NFD" || type == "NFKC" || type == "NFKD") {
    UErrorCode err = U_ZERO_ERROR;
    const icu::Normalizer2* norm = type == "NFC"    ? icu::Normalizer2::getNFCInstance(err)
                                   : type == "NFD"  ? icu::Normalizer2::getNFDInstance(err)
                                   : type == "NFKC" ? icu::Normalizer2::getNFKCInstance(err)
                                                    : icu::Normalizer2::getNFKDInstance(err);
    if (U_FAILURE(err)) throw data_error(where + ": ICU has no " + type + " normalizer");
    normalizers.push_back([norm](std::string& s) {
      UErrorCode e = U_ZERO_ERROR;
      if (norm->isNormalized(icu::UnicodeString::fromUTF8(s), e)) return;
      e = U_ZERO_ERROR;
      const auto out = norm->normalize(icu::UnicodeString::fromUTF8(s), e);
      s.clear();
      out.toUTF8String(s);
    });
  } else if (type == "Lowercase") {
    normalizers.push_back([](std::string& s) {
      auto u = icu::UnicodeString::fromUTF8(s);
      u.toLower(icu::Locale::getRoot());
      s.clear();
      u.toUTF8String(s);
    });
  } else if (type == "Strip") {
    const bool left = n.value("strip_left", false), right = n.value("strip_right", false);
    normalizers.push_back([left, right](std::string& s) {
      std::size_t b = 0, e = s.size();
      if (left)
        while (b < e && is_space(static_cast<unsigned char>(s[b]))) ++b;
      if (right)
        while (e > b && is_space(static_cast<unsigned char>(s[e - 1]))) --e;
      s = s.substr(b, e - b);
    });
  } else {
    throw data_error(where + ": the normalizer " + type +
                     " is not supported (Troupe reads Sequence, Prepend, Replace, NFC, NFD, NFKC, NFKD, Lowercase, Strip)");
  }
}

void hf_tokenizer::impl::parse_pre_tokenizer(const json& p) {
  if (p.is_null()) return;
  const auto type = p.at("type").get<std::string>();
  if (type == "Sequence") {
    for (const auto& x : p.at("pretokenizers")) parse_pre_tokenizer(x);
  } else if (type == "ByteLevel") {
    const bool prefix = p.value("add_prefix_space", false), use_regex = p.value("use_regex", true);
    const regex* re = nullptr;
    if (use_regex) {  // GPT-2's
      regexes.push_back(std::make_unique<regex>(
          R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)", false, where));
      re = regexes.back().get();
    }
    byte_level = true;
    pre_tokenizers.push_back([prefix, re](std::vector<piece>& pieces) {
      std::vector<piece> out;
      for (auto& p : pieces) {
        if (prefix && (p.text.empty() || p.text[0] != ' ')) p.text.insert(0, " ");
        if (re)
          split_piece(p, *re, split_behavior::isolated, false, out);
        else
          out.push_back(std::move(p));
      }
      const auto& a = alphabet();
      for (auto& p : out) {
        std::string mapped;
        mapped.reserve(p.text.size() * 2);
        for (const char c : p.text) mapped += a.to_char[static_cast<unsigned char>(c)];
        p.text.swap(mapped);
      }
      pieces.swap(out);
    });
  } else if (type == "Split") {
    const auto [pattern, literal] = pattern_of(p.at("pattern"), where);
    regexes.push_back(std::make_unique<regex>(pattern, literal, where));
    const regex* re = regexes.back().get();
    const auto behavior = parse_behavior(p.at("behavior").get<std::string>(), where);
    const bool invert = p.value("invert", false);
    pre_tokenizers.push_back([re, behavior, invert](std::vector<piece>& pieces) {
      std::vector<piece> out;
      for (const auto& p : pieces) split_piece(p, *re, behavior, invert, out);
      pieces.swap(out);
    });
  } else if (type == "Metaspace") {
    const auto replacement = p.value("replacement", metaspace);
    const auto scheme = prepend_scheme(p, where);
    const bool split = p.value("split", true);
    regexes.push_back(std::make_unique<regex>(replacement, true, where));
    const regex* re = regexes.back().get();
    pre_tokenizers.push_back([replacement, scheme, split, re](std::vector<piece>& pieces) {
      std::vector<piece> out;
      for (auto& p : pieces) {
        replace_all(p.text, " ", replacement);
        const bool starts = p.text.compare(0, replacement.size(), replacement) == 0;
        if (!starts && (scheme == "always" || (scheme == "first" && p.first))) p.text.insert(0, replacement);
        if (split)
          split_piece(p, *re, split_behavior::merged_with_next, false, out);
        else
          out.push_back(std::move(p));
      }
      pieces.swap(out);
    });
  } else if (type == "Digits") {
    const bool individual = p.value("individual_digits", false);
    regexes.push_back(std::make_unique<regex>("[0-9]", false, where));
    const regex* re = regexes.back().get();
    pre_tokenizers.push_back([re, individual](std::vector<piece>& pieces) {
      std::vector<piece> out;
      for (const auto& p : pieces)
        split_piece(p, *re, individual ? split_behavior::isolated : split_behavior::contiguous, false, out);
      pieces.swap(out);
    });
  } else {
    throw data_error(where + ": the pre-tokenizer " + type +
                     " is not supported (Troupe reads Sequence, ByteLevel, Split, Metaspace, Digits)");
  }
}

void hf_tokenizer::impl::parse_post_processor(const json& p) {
  if (p.is_null()) return;
  const auto type = p.at("type").get<std::string>();
  if (type == "Sequence") {
    for (const auto& x : p.at("processors")) parse_post_processor(x);
  } else if (type == "ByteLevel") {
    // offsets only
  } else if (type == "TemplateProcessing") {
    std::unordered_map<std::string, std::vector<int>> specials;
    for (const auto& [name, s] : p.at("special_tokens").items()) specials[name] = s.at("ids").get<std::vector<int>>();
    bool seen_sequence = false;
    for (const auto& item : p.at("single")) {
      if (item.contains("Sequence")) {
        seen_sequence = true;
      } else if (item.contains("SpecialToken")) {
        const auto name = item.at("SpecialToken").at("id").get<std::string>();
        const auto it = specials.find(name);
        if (it == specials.end()) throw data_error(where + ": the template's special token " + name + " has no ids");
        auto& to = seen_sequence ? suffix_ids : prefix_ids;
        to.insert(to.end(), it->second.begin(), it->second.end());
      }
    }
  } else if (type == "RobertaProcessing" || type == "BertProcessing") {
    prefix_ids.push_back(p.at("cls").at(1).get<int>());
    suffix_ids.insert(suffix_ids.begin(), p.at("sep").at(1).get<int>());
  } else {
    throw data_error(where + ": the post-processor " + type + " is not supported");
  }
}

void hf_tokenizer::impl::parse_decoder(const json& d) {
  if (d.is_null()) return;
  const auto type = d.at("type").get<std::string>();
  if (type == "Sequence") {
    for (const auto& x : d.at("decoders")) parse_decoder(x);
  } else if (type == "ByteLevel") {
    decoders.push_back([](std::vector<std::string>& tokens) {
      const auto& a = alphabet();
      std::string out;
      for (const auto& t : tokens)
        for (std::size_t i = 0; i < t.size();) {
          const std::size_t n = utf8_len(static_cast<unsigned char>(t[i]));
          const auto it = a.to_byte.find(t.substr(i, n));
          if (it != a.to_byte.end())
            out += char(it->second);
          else
            out.append(t, i, n);
          i += n;
        }
      tokens.assign(1, out);
    });
  } else if (type == "Replace") {
    const auto [pattern, literal] = pattern_of(d.at("pattern"), where);
    if (!literal) throw data_error(where + ": a Replace decoder with a regex is not supported");
    const auto content = d.at("content").get<std::string>();
    decoders.push_back([pattern = pattern, content](std::vector<std::string>& tokens) {
      for (auto& t : tokens) replace_all(t, pattern, content);
    });
  } else if (type == "ByteFallback") {
    decoders.push_back([](std::vector<std::string>& tokens) {
      for (auto& t : tokens)
        if (is_byte_piece(t))
          t = std::string(1, char(std::stoi(t.substr(3, 2), nullptr, 16)));
    });
  } else if (type == "Fuse") {
    decoders.push_back([](std::vector<std::string>& tokens) {
      std::string out;
      for (const auto& t : tokens) out += t;
      tokens.assign(1, out);
    });
  } else if (type == "Strip") {
    const auto content = d.at("content").get<std::string>();
    const int start = d.value("start", 0), stop = d.value("stop", 0);
    decoders.push_back([content, start, stop](std::vector<std::string>& tokens) {
      for (auto& t : tokens) {
        for (int i = 0; i < start && t.compare(0, content.size(), content) == 0; ++i) t.erase(0, content.size());
        for (int i = 0; i < stop && t.size() >= content.size() &&
                        t.compare(t.size() - content.size(), content.size(), content) == 0;
             ++i)
          t.erase(t.size() - content.size());
      }
    });
  } else if (type == "Metaspace") {
    const auto replacement = d.value("replacement", metaspace);
    const auto scheme = prepend_scheme(d, where);
    decoders.push_back([replacement, scheme](std::vector<std::string>& tokens) {
      for (std::size_t i = 0; i < tokens.size(); ++i) {
        replace_all(tokens[i], replacement, " ");
        if (i == 0 && scheme != "never" && !tokens[i].empty() && tokens[i][0] == ' ') tokens[i].erase(0, 1);
      }
    });
  } else {
    throw data_error(where + ": the decoder " + type + " is not supported");
  }
}

namespace {
/// A token's text in tokenizer_config.json: a string, or an AddedToken's {"content": ...}.
std::string token_text(const json& t) {
  if (t.is_string()) return t.get<std::string>();
  if (t.is_object() && t.contains("content")) return t.at("content").get<std::string>();
  return "";
}

/// An added token as tokenizer.json's added_tokens and tokenizer_config.json's
/// added_tokens_decoder write it.
added_token added_token_of(int id, const json& t) {
  added_token a;
  a.id = id;
  a.content = t.at("content").get<std::string>();
  a.single_word = t.value("single_word", false);
  a.lstrip = t.value("lstrip", false);
  a.rstrip = t.value("rstrip", false);
  a.normalized = t.value("normalized", false);
  a.special = t.value("special", false);
  return a;
}
}  // namespace

bool tokenizer_config::llama_class() const {
  for (const char* cls : {"LlamaTokenizer", "LlamaTokenizerFast", "CodeLlamaTokenizer", "CodeLlamaTokenizerFast"})
    if (tokenizer_class == cls) return true;
  return false;
}

tokenizer_config tokenizer_config::read(const std::string& path) {
  tokenizer_config out;
  if (path.empty()) return out;
  try {
    const auto bytes = read_file_bytes(path);
    const auto c = json::parse(bytes.begin(), bytes.end());
    out.tokenizer_class = c.value("tokenizer_class", "");
    out.bos_token = token_text(c.value("bos_token", json()));
    out.eos_token = token_text(c.value("eos_token", json()));
    out.unk_token = token_text(c.value("unk_token", json()));
    if (c.contains("add_bos_token")) out.add_bos_token = c.at("add_bos_token").get<bool>();
    if (c.contains("add_eos_token")) out.add_eos_token = c.at("add_eos_token").get<bool>();
    for (const auto& [key, field] : {std::pair{"legacy", &out.legacy}, {"add_prefix_space", &out.add_prefix_space}})
      if (c.contains(key) && c.at(key).is_boolean()) *field = c.at(key).get<bool>();
    if (c.contains("added_tokens_decoder"))
      for (const auto& [id, t] : c.at("added_tokens_decoder").items()) out.added_tokens.push_back(added_token_of(std::stoi(id), t));
  } catch (const std::exception& e) {
    throw data_error("tokenizer config " + path + " cannot be read: " + e.what());
  }
  return out;
}

namespace {

/// The text of tokenizer.json `path`; throws data_error naming it.
std::string tokenizer_text(const std::string& path) {
  try {
    const auto bytes = read_file_bytes(path);
    return std::string(bytes.begin(), bytes.end());
  } catch (const std::exception& e) {
    throw data_error("tokenizer " + path + " cannot be read: " + e.what());
  }
}

}  // namespace

hf_tokenizer::hf_tokenizer(const std::string& path, const tokenizer_config& config)
    : hf_tokenizer(text_tag{}, "tokenizer " + path, tokenizer_text(path), config) {}

std::unique_ptr<hf_tokenizer> hf_tokenizer::from_text(const std::string& json_text, const std::string& where,
                                                      const tokenizer_config& config) {
  return std::unique_ptr<hf_tokenizer>(new hf_tokenizer(text_tag{}, where, json_text, config));
}

hf_tokenizer::hf_tokenizer(text_tag, const std::string& where, const std::string& text, const tokenizer_config& config)
    : impl_(std::make_unique<impl>()) {
  auto& m = *impl_;
  m.where = where;
  json j;
  try {
    j = json::parse(text);
  } catch (const std::exception& e) {
    throw data_error(m.where + " cannot be read as JSON: " + e.what());
  }
  try {
    const auto& model = j.at("model");
    const std::string type = model.value("type", model.contains("merges") ? "BPE" : "");
    if (type != "BPE")
      throw data_error(m.where + ": its model is " + (type.empty() ? std::string("of no type") : type) +
                       "; Troupe reads BPE tokenizers (byte-level, or with byte fallback), not WordPiece, Unigram "
                       "or WordLevel");
    if (!model.value("continuing_subword_prefix", json()).is_null() &&
        !model.at("continuing_subword_prefix").get<std::string>().empty())
      throw data_error(m.where + ": a BPE continuing_subword_prefix is not supported");
    if (!model.value("end_of_word_suffix", json()).is_null() && !model.at("end_of_word_suffix").get<std::string>().empty())
      throw data_error(m.where + ": a BPE end_of_word_suffix is not supported");
    if (model.contains("dropout") && !model.at("dropout").is_null() && model.at("dropout").get<double>() > 0)
      throw data_error(m.where + ": BPE dropout samples its merges; AutoTokenizer's ids are those without it");
    for (const auto& [token, id] : model.at("vocab").items()) m.vocab[token] = id.get<int>();
    m.fuse_unk = model.value("fuse_unk", false);
    m.byte_fallback = model.value("byte_fallback", false);
    m.ignore_merges = model.value("ignore_merges", false);
    if (model.contains("unk_token") && model.at("unk_token").is_string()) m.unk = m.id_of(model.at("unk_token"));
    int rank = 0;
    for (const auto& mg : model.at("merges")) {
      std::string a, b;
      if (mg.is_string()) {
        const auto s = mg.get<std::string>();
        const auto sp = s.find(' ');
        if (sp == std::string::npos) throw data_error(m.where + ": merge '" + s + "' is not two tokens");
        a = s.substr(0, sp);
        b = s.substr(sp + 1);
      } else {
        a = mg.at(0).get<std::string>();
        b = mg.at(1).get<std::string>();
      }
      const int ia = m.id_of(a), ib = m.id_of(b), iab = m.id_of(a + b);
      if (ia < 0 || ib < 0 || iab < 0) throw data_error(m.where + ": merge '" + a + " " + b + "' is not in the vocabulary");
      m.merges.emplace((std::uint64_t(std::uint32_t(ia)) << 32) | std::uint32_t(ib), std::make_pair(rank++, iab));
    }
    std::vector<added_token> added;
    if (j.contains("added_tokens"))
      for (const auto& t : j.at("added_tokens")) added.push_back(added_token_of(t.at("id").get<int>(), t));
    int size = 0;
    for (const auto& [t, id] : m.vocab) size = std::max(size, id + 1);
    for (const auto& a : added) size = std::max(size, a.id + 1);
    m.id_to_token.assign(std::size_t(size), "");
    m.special.assign(std::size_t(size), false);
    for (const auto& [t, id] : m.vocab) m.id_to_token[std::size_t(id)] = t;
    for (const auto& a : added) {
      m.id_to_token[std::size_t(a.id)] = a.content;
      m.special[std::size_t(a.id)] = a.special;
    }
    for (int b = 0; b < 256; ++b) {
      char name[8];
      std::snprintf(name, sizeof name, "<0x%02X>", b);
      m.byte_ids[b] = m.id_of(name);
    }
    m.added = added_vocabulary(std::move(added));
    m.parse_normalizer(j.value("normalizer", json()));
    m.parse_pre_tokenizer(j.value("pre_tokenizer", json()));
    m.parse_post_processor(j.value("post_processor", json()));
    m.parse_decoder(j.value("decoder", json()));
    if (j.contains("truncation") && !j.at("truncation").is_null())
      throw data_error(m.where + ": truncation would cut documents; AutoTokenizer's call does not truncate by default");
  } catch (const json::exception& e) {
    throw data_error(m.where + " is not a tokenizer.json `tokenizers` writes: " + e.what());
  }

  // tokenizer_config.json: the special tokens' names and AutoTokenizer's add_bos/eos_token.
  auto id_of_any = [&](const std::string& t) {
    if (t.empty()) return -1;
    const int id = m.id_of(t);
    if (id >= 0) return id;
    for (const auto& a : m.added.tokens())
      if (a.content == t) return a.id;
    return -1;
  };
  m.eos = id_of_any(config.eos_token);
  m.bos = id_of_any(config.bos_token);
  // Set explicitly, they replace the post-processor's template (transformers'
  // update_post_processor; the Llama classes of transformers 4 also by default).
  const bool llama = config.llama_class();
  if (config.add_bos_token >= 0 || config.add_eos_token >= 0 || (llama && m.prefix_ids.empty())) {
    const bool add_bos = config.add_bos_token >= 0 ? config.add_bos_token == 1 : llama;
    m.prefix_ids.clear();
    m.suffix_ids.clear();
    if (add_bos && m.bos >= 0) m.prefix_ids.push_back(m.bos);
    if (config.add_eos_token == 1 && m.eos >= 0) m.suffix_ids.push_back(m.eos);
  }
}

hf_tokenizer::~hf_tokenizer() = default;

int hf_tokenizer::size() const { return int(impl_->id_to_token.size()); }
int hf_tokenizer::eos_id() const { return impl_->eos; }
int hf_tokenizer::bos_id() const { return impl_->bos; }
std::string hf_tokenizer::describe() const {
  return impl_->byte_level ? "byte-level BPE" : impl_->byte_fallback ? "BPE with byte fallback" : "BPE";
}

void hf_tokenizer::impl::bpe(const std::string& word, std::vector<int>& out) const {
  if (ignore_merges) {
    const int id = id_of(word);
    if (id >= 0) {
      out.push_back(id);
      return;
    }
  }
  // The word's characters as symbols (a doubly linked list), each in the vocabulary, as
  // its bytes' <0xNN> pieces, or unknown.
  struct symbol {
    int id, prev, next;
    bool alive;
  };
  std::vector<symbol> sym;
  sym.reserve(word.size());
  for (std::size_t i = 0; i < word.size();) {
    const std::size_t n = std::min(utf8_len(static_cast<unsigned char>(word[i])), word.size() - i);
    const int id = id_of(word.substr(i, n));
    auto push = [&](int x) { sym.push_back({x, int(sym.size()) - 1, int(sym.size()) + 1, true}); };
    if (id >= 0) {
      push(id);
    } else {
      bool bytes = byte_fallback;
      for (std::size_t k = 0; bytes && k < n; ++k) bytes = byte_ids[static_cast<unsigned char>(word[i + k])] >= 0;
      if (bytes) {
        for (std::size_t k = 0; k < n; ++k) push(byte_ids[static_cast<unsigned char>(word[i + k])]);
      } else if (unk >= 0 && !(fuse_unk && !sym.empty() && sym.back().id == unk)) {
        push(unk);
      }
    }
    i += n;
  }
  if (sym.empty()) return;
  sym.back().next = -1;
  // Merges by rank, the leftmost first among equal ranks (`tokenizers`' heap).
  using entry = std::tuple<int, int, int, int>;  // rank, left position, right id at push, merged id
  std::priority_queue<entry, std::vector<entry>, std::greater<entry>> heap;
  auto push_pair = [&](int left) {
    const int right = sym[std::size_t(left)].next;
    if (right < 0) return;
    const auto it = merges.find((std::uint64_t(std::uint32_t(sym[std::size_t(left)].id)) << 32) |
                                std::uint32_t(sym[std::size_t(right)].id));
    if (it != merges.end()) heap.emplace(it->second.first, left, sym[std::size_t(right)].id, it->second.second);
  };
  for (int i = 0; i + 1 < int(sym.size()); ++i) push_pair(i);
  while (!heap.empty()) {
    const auto [rank, left, right_id, merged] = heap.top();
    heap.pop();
    auto& l = sym[std::size_t(left)];
    if (!l.alive || l.next < 0) continue;
    auto& r = sym[std::size_t(l.next)];
    // Stale: the left or right symbol changed since the pair was pushed.
    const auto it = merges.find((std::uint64_t(std::uint32_t(l.id)) << 32) | std::uint32_t(r.id));
    if (r.id != right_id || it == merges.end() || it->second.second != merged) continue;
    l.id = merged;
    r.alive = false;
    l.next = r.next;
    if (r.next >= 0) sym[std::size_t(r.next)].prev = left;
    if (l.prev >= 0) push_pair(l.prev);
    push_pair(left);
  }
  for (int i = 0; i >= 0; i = sym[std::size_t(i)].next) out.push_back(sym[std::size_t(i)].id);
}

void hf_tokenizer::impl::encode_segment(std::string_view text, bool first, std::vector<int>& out) const {
  std::string s(text);
  for (const auto& n : normalizers) n(s);
  // Added tokens whose `normalized` is true match the normalized text.
  for (const auto& part : added.split(s, true)) {
    if (part.id >= 0) {
      out.push_back(part.id);
      continue;
    }
    std::vector<piece> pieces{{std::string(part.text), first && part.begin == 0}};
    for (const auto& p : pre_tokenizers) p(pieces);
    // Words repeat: each thread keeps what it has computed, per tokenizer.
    thread_local std::unordered_map<std::uint64_t, std::unordered_map<std::string, std::vector<int>>> caches;
    if (caches.size() > 8 && !caches.count(serial)) caches.clear();  // (tokenizers gone since)
    auto& cache = caches[serial];
    if (cache.size() > (1u << 20)) cache.clear();
    for (const auto& p : pieces) {
      auto it = cache.find(p.text);
      if (it == cache.end()) {
        std::vector<int> ids;
        bpe(p.text, ids);
        it = cache.emplace(p.text, std::move(ids)).first;
      }
      out.insert(out.end(), it->second.begin(), it->second.end());
    }
  }
}

std::vector<int> hf_tokenizer::encode(std::string_view text) const {
  const auto& m = *impl_;
  std::size_t bad = 0;
  if (!valid_utf8(text, &bad))
    throw data_error("text that is not UTF-8 (byte " + std::to_string(bad) + "): " + m.where + " encodes Unicode text");
  std::vector<int> out(m.prefix_ids);
  out.reserve(text.size() / 3 + m.prefix_ids.size() + m.suffix_ids.size() + 4);
  for (const auto& part : m.added.split(text, false)) {
    if (part.id >= 0)
      out.push_back(part.id);
    else
      m.encode_segment(part.text, part.begin == 0, out);
  }
  out.insert(out.end(), m.suffix_ids.begin(), m.suffix_ids.end());
  return out;
}

std::string hf_tokenizer::decode(const std::vector<int>& ids) const {
  const auto& m = *impl_;
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (const int id : ids)
    if (id >= 0 && id < size()) tokens.push_back(m.id_to_token[std::size_t(id)]);
  for (const auto& d : m.decoders) d(tokens);
  std::string out;
  for (const auto& t : tokens) out += t;
  return out;
}

std::vector<std::int32_t> hf_tokenizer::piece_bytes() const {
  const auto& m = *impl_;
  std::vector<std::int32_t> out(m.id_to_token.size(), 0);
  const auto& a = alphabet();
  for (std::size_t id = 0; id < out.size(); ++id) {
    const auto& t = m.id_to_token[id];
    if (m.special[id] || t.empty()) continue;
    if (m.byte_fallback && is_byte_piece(t)) {
      out[id] = 1;
      continue;
    }
    std::int32_t n = 0;
    for (std::size_t i = 0; i < t.size();) {
      const std::size_t len = utf8_len(static_cast<unsigned char>(t[i]));
      if (m.byte_level)
        n += a.to_byte.count(t.substr(i, len)) ? 1 : std::int32_t(len);
      else
        n += t.compare(i, metaspace.size(), metaspace) == 0 ? 1 : std::int32_t(len);
      i += len;
    }
    out[id] = n;
  }
  return out;
}

std::string llama_tokenizer_json(const std::vector<sentencepiece_piece>& pieces, const tokenizer_config& config) {
  using kind = sentencepiece_piece::kind;
  json vocab = json::object();
  std::unordered_map<std::string, int> ids;
  for (std::size_t i = 0; i < pieces.size(); ++i) {
    vocab[pieces[i].text] = int(i);
    ids.emplace(pieces[i].text, int(i));
  }
  // transformers' generate_merges: each piece split at each character boundary into two
  // pieces of the vocabulary, ranked by the merged piece's id, then the left part's length.
  json merges = json::array();
  for (const auto& p : pieces)
    for (std::size_t at = p.text.empty() ? 0 : utf8_len(static_cast<unsigned char>(p.text[0])); at < p.text.size();
         at += utf8_len(static_cast<unsigned char>(p.text[at]))) {
      const auto left = p.text.substr(0, at), right = p.text.substr(at);
      if (ids.count(left) && ids.count(right)) merges.push_back({left, right});
    }
  json added = json::array();
  std::set<int> taken;
  const auto add = [&](int id, const std::string& content, bool special) {
    if (id < 0 || !taken.insert(id).second) return;
    added.push_back({{"id", id}, {"content", content}, {"single_word", false}, {"lstrip", false}, {"rstrip", false},
                     {"normalized", false}, {"special", special}});
  };
  const auto id_of = [&](const std::string& t) { return ids.count(t) ? ids.at(t) : -1; };
  for (const auto& t : {config.unk_token, config.bos_token, config.eos_token})
    if (!t.empty()) add(id_of(t), t, true);
  for (std::size_t i = 0; i < pieces.size(); ++i)
    if (pieces[i].type == kind::control || pieces[i].type == kind::user_defined)
      add(int(i), pieces[i].text, pieces[i].type == kind::control);
  for (const auto& a : config.added_tokens)
    if (taken.insert(a.id).second)
      added.push_back({{"id", a.id}, {"content", a.content}, {"single_word", a.single_word}, {"lstrip", a.lstrip},
                       {"rstrip", a.rstrip}, {"normalized", a.normalized}, {"special", a.special}});
  const bool prefix_space = config.add_prefix_space != 0;
  const std::string scheme = !prefix_space ? "never" : config.legacy == 1 ? "always" : "first";
  const std::string space = "\xe2\x96\x81";  // U+2581
  json decoders = json::array({json{{"type", "Replace"}, {"pattern", {{"String", space}}}, {"content", " "}},
                               json{{"type", "ByteFallback"}}, json{{"type", "Fuse"}}});
  if (prefix_space) decoders.push_back({{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}});
  const json j = {
      {"version", "1.0"},
      {"added_tokens", added},
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "Metaspace"}, {"replacement", space}, {"prepend_scheme", scheme}, {"split", false}}},
      {"post_processor", nullptr},
      {"decoder", {{"type", "Sequence"}, {"decoders", decoders}}},
      {"model",
       {{"type", "BPE"},
        {"vocab", vocab},
        {"merges", merges},
        {"unk_token", nullptr},
        {"fuse_unk", true},
        {"byte_fallback", true},
        {"ignore_merges", false}}}};
  return j.dump();
}

}  // namespace troupe
