#include "compute/data/tokenizer.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <unordered_map>
#include <algorithm>
#include <string_view>
#include <functional>

#include <dlfcn.h>


#include "compute/runtime/file_bytes.hpp"
#include "compute/data/hf_tokenizer.hpp"
#include "compute/data/spm_plugin.hpp"
#include "compute/runtime/splitmix.hpp"

namespace troupe {

namespace fs = std::filesystem;

namespace {

std::string hex64(std::uint64_t x) {
  char text[20];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(x));
  return text;
}

/// The SentencePiece plugin (spm_plugin.hpp), loaded once, beside this executable.
const troupe_spm_api& spm() {
  static const troupe_spm_api* api = [] {
    std::error_code ec;
    const auto exe = fs::read_symlink("/proc/self/exe", ec);
    const auto path = (exe.parent_path() / "libtroupe_spm.so").string();
    void* lib = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
    if (!lib) throw data_error(std::string("cannot load the SentencePiece plugin: ") + ::dlerror());
    auto entry = reinterpret_cast<const troupe_spm_api* (*)()>(::dlsym(lib, "troupe_spm"));
    if (!entry) throw data_error(path + " has no entry point troupe_spm");
    return entry();
  }();
  return *api;
}

constexpr char cache_magic[8] = {'T', 'R', 'P', 'T', 'O', 'K', '0', '1'};

/// The cache file's header: magic, the fingerprint's hash, the two streams' lengths.
struct cache_header {
  char magic[8];
  std::uint64_t fingerprint;
  std::uint64_t n_train, n_valid;
};

/// A protocol-buffer varint at `at` of `b` (advanced past it); throws past the end.
std::uint64_t varint(std::string_view b, std::size_t& at) {
  std::uint64_t v = 0;
  for (int shift = 0; shift < 64; shift += 7) {
    if (at >= b.size()) throw std::runtime_error("truncated");
    const auto c = static_cast<unsigned char>(b[at++]);
    v |= std::uint64_t(c & 0x7f) << shift;
    if (!(c & 0x80)) return v;
  }
  throw std::runtime_error("a varint of more than 64 bits");
}

/// Calls `each(field, value)` for each field of the message `b` (value: a varint's or a
/// length-delimited field's bytes; fixed-width fields skipped).
void for_each_field(std::string_view b, const std::function<void(int, std::uint64_t, std::string_view)>& each) {
  for (std::size_t at = 0; at < b.size();) {
    const auto key = varint(b, at);
    const int field = int(key >> 3);
    switch (key & 7) {
      case 0: each(field, varint(b, at), {}); break;
      case 1: at += 8; break;
      case 5: at += 4; break;
      case 2: {
        const auto n = varint(b, at);
        if (n > b.size() - at) throw std::runtime_error("a field past the end");
        each(field, 0, b.substr(at, n));
        at += n;
        break;
      }
      default: throw std::runtime_error("wire type " + std::to_string(key & 7));
    }
    if (at > b.size()) throw std::runtime_error("truncated");
  }
}

/// The pieces of a SentencePiece model (ModelProto's field 1: each SentencePiece's piece,
/// field 1, and type, field 3), by id. (Debian's SentencePiece tells no user-defined type.)
std::vector<sentencepiece_piece> sentencepiece_pieces(std::string_view model, const std::string& where) {
  using kind = sentencepiece_piece::kind;
  std::vector<sentencepiece_piece> out;
  try {
    for_each_field(model, [&](int field, std::uint64_t, std::string_view piece) {
      if (field != 1) return;
      sentencepiece_piece p;
      for_each_field(piece, [&](int f, std::uint64_t v, std::string_view bytes) {
        if (f == 1) p.text = std::string(bytes);
        if (f == 3)  // NORMAL 1, UNKNOWN 2, CONTROL 3, USER_DEFINED 4, UNUSED 5, BYTE 6
          p.type = v == 2 || v == 5 ? kind::unknown : v == 3 ? kind::control : v == 4 ? kind::user_defined
                   : v == 6 ? kind::byte : kind::normal;
      });
      out.push_back(std::move(p));
    });
  } catch (const std::exception& e) {
    throw data_error("tokenizer " + where + ": its pieces cannot be read (" + e.what() + ")");
  }
  return out;
}

}  // namespace

/// What a tokenizer is made of: a SentencePiece processor (a model file of its own, or a
/// folder's tokenizer.model of a class other than Llama's), or a tokenizer.json (a
/// folder's, or the one transformers 5 builds from a Llama folder's tokenizer.model).
struct tokenizer::impl {
  void* sp = nullptr;  ///< the plugin's processor (compute/data/spm_plugin.hpp)
  std::unique_ptr<hf_tokenizer> hf;
  // A folder's tokenizer.model (not Llama's class): its special tokens split out, BOS/EOS
  // added as tokenizer_config.json says.
  bool folder = false, add_bos = false, add_eos = false;
  added_vocabulary added;
  int bos = -1, eos = -1;
  ~impl() {
    if (sp) spm().release(sp);
  }
  int sp_id(const std::string& piece) const {
    for (int id = 0; id < spm().size(sp); ++id)
      if (*spm().piece(sp, id) == piece) return id;
    return -1;
  }
};

bool tokenizer::in_folder(const std::string& dir) {
  return fs::is_regular_file(fs::path(dir) / "tokenizer.json") || fs::is_regular_file(fs::path(dir) / "tokenizer.model");
}

tokenizer::tokenizer(const std::string& path) : path_(path), impl_(std::make_unique<impl>()) {
  const bool folder = fs::is_directory(path);
  if (folder && !in_folder(path))
    throw data_error("tokenizer folder " + path + " has neither tokenizer.json nor tokenizer.model");
  if (!folder && !fs::is_regular_file(path)) throw data_error("tokenizer " + path + " does not exist (or is not a file)");
  const fs::path dir = folder ? fs::path(path) : fs::path(path).parent_path();
  const fs::path json_file = folder ? dir / "tokenizer.json" : fs::path(path);
  const bool is_json = fs::is_regular_file(json_file) && (folder || json_file.extension() == ".json");
  const fs::path file = is_json ? json_file : folder ? dir / "tokenizer.model" : fs::path(path);
  const fs::path config = dir / "tokenizer_config.json";
  const bool has_config = (folder || is_json) && fs::is_regular_file(config);
  std::vector<char> bytes;
  std::size_t model_bytes = 0;
  try {
    bytes = read_file_bytes(file.string());
    model_bytes = bytes.size();
    if (has_config) {  // the fingerprint covers the settings too
      const auto more = read_file_bytes(config.string());
      bytes.insert(bytes.end(), more.begin(), more.end());
    }
  } catch (const std::exception& e) {
    throw data_error("tokenizer " + file.string() + ": " + e.what());
  }
  const auto settings = tokenizer_config::read(has_config ? config.string() : "");
  if (is_json) {
    impl_->hf = std::make_unique<hf_tokenizer>(file.string(), settings);
  } else {
    std::string error;
    impl_->sp = spm().load(std::string(bytes.begin(), bytes.begin() + std::ptrdiff_t(model_bytes)), error);
    if (!impl_->sp)
      throw data_error("tokenizer " + file.string() + " is not a SentencePiece model (" + error +
                       "): make one with troupe tokenizer, or give a tokenizer.json or a model folder");
    // A folder's special tokens, named by tokenizer_config.json or as Llama's are.
    auto names = settings;
    for (auto [name, fallback] :
         {std::pair{&names.bos_token, "<s>"}, {&names.eos_token, "</s>"}, {&names.unk_token, "<unk>"}})
      if (name->empty()) *name = fallback;
    if (folder && (settings.tokenizer_class.empty() || settings.llama_class())) {
      // transformers 5's LlamaTokenizer: the model's pieces as a BPE (llama_tokenizer_json),
      // BOS and EOS only where tokenizer_config.json adds them.
      const auto pieces = sentencepiece_pieces(std::string_view(bytes.data(), model_bytes), file.string());
      names.add_bos_token = std::max(0, names.add_bos_token);
      names.add_eos_token = std::max(0, names.add_eos_token);
      impl_->hf = hf_tokenizer::from_text(llama_tokenizer_json(pieces, names),
                                          "tokenizer " + file.string() + " (as transformers 5's LlamaTokenizer)", names);
      spm().release(impl_->sp);
      impl_->sp = nullptr;
    } else if (folder) {
      // Another class's tokenizer.model: SentencePiece's ids, with the special tokens split
      // out and BOS/EOS added as tokenizer_config.json says.
      auto& m = *impl_;
      m.folder = true;
      m.add_bos = settings.add_bos_token == 1;
      m.add_eos = settings.add_eos_token == 1;
      m.bos = m.sp_id(names.bos_token);
      m.eos = m.sp_id(names.eos_token);
      std::vector<added_token> added = settings.added_tokens;
      for (const auto& name : {names.bos_token, names.eos_token, names.unk_token}) {
        const int id = m.sp_id(name);
        if (id >= 0) added.push_back({id, name, false, false, false, false, true});
      }
      m.added = added_vocabulary(std::move(added));
    } else {
      impl_->eos = impl_->sp_id("</s>");
    }
  }
  // (A Llama folder's tokenizer.model read as transformers 5 converts it gives other ids
  // than SentencePiece: its caches and checkpoints are told apart.)
  fingerprint_ = std::to_string(size()) + " pieces, fnv1a " + hex64(fnv1a(bytes.data(), bytes.size())) +
                 (impl_->hf && !is_json ? ", as transformers 5's BPE" : "");
}

tokenizer::~tokenizer() = default;

int tokenizer::size() const { return impl_->hf ? impl_->hf->size() : spm().size(impl_->sp); }

int tokenizer::eos_id() const { return impl_->hf ? impl_->hf->eos_id() : impl_->eos; }

std::string tokenizer::describe() const { return impl_->hf ? impl_->hf->describe() : "SentencePiece"; }

std::vector<int> tokenizer::encode(const std::string& text) const {
  if (impl_->hf) return impl_->hf->encode(text);
  std::vector<int> ids;
  std::string error;
  auto sp_encode = [&](const std::string& s) {
    std::vector<int> part;
    if (!spm().encode(impl_->sp, s, part, error)) throw data_error("tokenizer " + path_ + " cannot encode: " + error);
    ids.insert(ids.end(), part.begin(), part.end());
  };
  if (!impl_->folder) {
    sp_encode(text);
    return ids;
  }
  if (impl_->add_bos && impl_->bos >= 0) ids.push_back(impl_->bos);
  for (const auto& part : impl_->added.split(text, false)) {
    if (part.id >= 0)
      ids.push_back(part.id);
    else
      sp_encode(std::string(part.text));
  }
  if (impl_->add_eos && impl_->eos >= 0) ids.push_back(impl_->eos);
  return ids;
}

std::string tokenizer::decode(const std::vector<int>& ids) const {
  if (impl_->hf) return impl_->hf->decode(ids);
  std::string text, error;
  if (!spm().decode(impl_->sp, ids, text, error)) throw data_error("tokenizer " + path_ + " cannot decode: " + error);
  return text;
}

std::vector<std::int32_t> tokenizer::piece_bytes() const {
  if (impl_->hf) return impl_->hf->piece_bytes();
  void* sp = impl_->sp;
  std::vector<std::int32_t> out(std::size_t(size()), 0);
  static const std::string space = "\xe2\x96\x81";  // U+2581, the space a piece stands for
  for (int id = 0; id < size(); ++id) {
    const int kind = spm().kind(sp, id);
    if (kind == 1) continue;  // control: no bytes
    if (kind == 2) {          // <0xNN>
      out[std::size_t(id)] = 1;
      continue;
    }
    const auto& piece = *spm().piece(sp, id);
    std::int32_t n = 0;
    for (std::size_t i = 0; i < piece.size(); ++n) i += piece.compare(i, space.size(), space) == 0 ? space.size() : 1;
    out[std::size_t(id)] = n;
  }
  return out;
}

void tokenizer::train(const std::vector<std::string>& lines, int vocab_size, const std::string& out) {
  if (lines.empty()) throw data_error("no text to train a tokenizer on");
  const std::vector<std::pair<std::string, std::string>> options{
      {"model_type", "bpe"},
      {"vocab_size", std::to_string(vocab_size)},
      {"normalization_rule_name", "identity"},
      {"remove_extra_whitespaces", "false"},
      {"add_dummy_prefix", "false"},
      {"byte_fallback", "true"},
      {"character_coverage", "1.0"},
      {"num_threads", "2"},
      {"minloglevel", "2"},
  };
  std::string model, error;
  if (!spm().train(options, lines, model, error))
    throw data_error("cannot train a tokenizer of " + std::to_string(vocab_size) + " pieces: " + error);
  write_file_atomically(out, model);
}

int padded_vocab(int size) { return (size + 127) / 128 * 128; }

tokenizer_info tokenizer_info_of(const std::string& path) {
  static std::mutex m;
  static std::map<std::string, tokenizer_info> known;
  std::lock_guard<std::mutex> lock(m);
  auto it = known.find(path);
  if (it == known.end()) {
    const tokenizer tok(path);
    it = known.emplace(path, tokenizer_info{tok.size(), tok.fingerprint(), tok.eos_id()}).first;
  }
  return it->second;
}

namespace {
std::string process_cache_dir;  // set_default_cache_dir
}  // namespace

void set_default_cache_dir(const std::string& dir) { process_cache_dir = dir; }

std::string default_cache_dir() {
  return process_cache_dir.empty() ? (fs::temp_directory_path() / "troupe-cache").string() : process_cache_dir;
}

token_file::token_file(const std::string& path, std::size_t offset, std::size_t count, int width, bool is_signed,
                       const std::string& what)
    : path_(path), count_(count), width_(width), signed_(is_signed) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw data_error("cannot open " + what + " " + path + ": " + std::strerror(errno));
  struct stat st {};
  ::fstat(fd, &st);
  mapped_ = std::size_t(st.st_size);
  if (mapped_ < offset + count * std::size_t(width)) {
    ::close(fd);
    throw data_error(what + " " + path + " holds " + std::to_string(mapped_) + " bytes; its index says " +
                     std::to_string(offset + count * std::size_t(width)));
  }
  if (mapped_ > 0) {
    map_ = ::mmap(nullptr, mapped_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map_ == MAP_FAILED) {
      map_ = nullptr;
      ::close(fd);
      throw data_error("cannot map " + what + " " + path + ": " + std::strerror(errno));
    }
    ids_ = static_cast<const unsigned char*>(map_) + offset;
  }
  ::close(fd);
}

token_file::~token_file() {
  if (map_) ::munmap(map_, mapped_);
}

std::int64_t token_file::operator[](std::size_t i) const {
  const unsigned char* p = ids_ + i * std::size_t(width_);
  switch (width_) {
    case 1: {
      return signed_ ? std::int64_t(std::int8_t(*p)) : std::int64_t(*p);
    }
    case 2: {
      std::uint16_t x;
      std::memcpy(&x, p, 2);
      return signed_ ? std::int64_t(std::int16_t(x)) : std::int64_t(x);
    }
    case 4: {
      std::int32_t x;
      std::memcpy(&x, p, 4);
      return x;
    }
    default: {
      std::int64_t x;
      std::memcpy(&x, p, 8);
      return x;
    }
  }
}

token_corpus::token_corpus(const text_corpus& text, const std::string& text_fingerprint, const tokenizer& tok,
                           const std::string& cache_dir) {
  const std::string identity = "text " + text_fingerprint + "; tokenizer " + tok.fingerprint();
  const std::uint64_t fingerprint = fnv1a(identity.data(), identity.size());
  const fs::path dir = cache_dir.empty() ? fs::path(default_cache_dir()) : fs::path(cache_dir);
  const std::string file = (dir / ("tokens-" + hex64(fingerprint) + ".bin")).string();
  if (!fs::exists(file)) {  // encode once: the splits, each as one string
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) throw data_error("cannot make the token cache folder " + dir.string() + ": " + ec.message());
    auto split = [&](std::size_t begin, std::size_t count) {
      const auto bytes = text.bytes(begin, count);
      const std::string s(bytes.begin(), bytes.end());
      auto ids = tok.encode(s);
      if (tok.decode(ids) != s)
        throw data_error("tokenizer " + tok.path() + " does not give back the text's bytes (is the text valid "
                         "UTF-8?): tokens would not stand for the text");
      return ids;
    };
    const auto train = split(0, text.n_train()), valid = split(text.n_train(), text.n_valid());
    cache_header h{};
    std::memcpy(h.magic, cache_magic, 8);
    h.fingerprint = fingerprint;
    h.n_train = train.size();
    h.n_valid = valid.size();
    write_file_atomically(file, [&](const byte_sink& sink) {
      sink(reinterpret_cast<const char*>(&h), sizeof h);
      static_assert(sizeof(int) == sizeof(std::int32_t), "token ids are 32-bit");
      sink(reinterpret_cast<const char*>(train.data()), train.size() * 4);
      sink(reinterpret_cast<const char*>(valid.data()), valid.size() * 4);
    });
    written_ = true;
  }
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw data_error("cannot open the token cache " + file + ": " + std::strerror(errno));
  struct stat st {};
  ::fstat(fd, &st);
  cache_header h{};
  const auto size = std::size_t(st.st_size);
  const bool ok = size >= sizeof h && ::pread(fd, &h, sizeof h, 0) == ssize_t(sizeof h) &&
                  std::memcmp(h.magic, cache_magic, 8) == 0 && h.fingerprint == fingerprint &&
                  size == sizeof h + 4 * (h.n_train + h.n_valid);
  ::close(fd);
  if (!ok)
    throw data_error("token cache " + file + " is not the cache of this text and tokenizer (a fingerprint or " +
                     "size that disagrees): remove it and run again");
  stream_.push_back(std::make_shared<const token_file>(file, sizeof h, h.n_train + h.n_valid, 4, true, "the token cache"));
  begins_.push_back(0);
  n_train_ = h.n_train;
  n_valid_ = h.n_valid;
}

token_corpus::token_corpus(std::vector<std::shared_ptr<const token_file>> stream, std::size_t n_train)
    : stream_(std::move(stream)), n_train_(n_train) {
  std::size_t total = 0;
  for (const auto& f : stream_) {
    begins_.push_back(total);
    total += f->size();
  }
  if (n_train_ > total) throw data_error("a training split past the stream's end");
  n_valid_ = total - n_train_;
}

token_corpus::~token_corpus() = default;

std::int64_t token_corpus::token(std::size_t i) const {
  const auto k = std::size_t(std::upper_bound(begins_.begin(), begins_.end(), i) - begins_.begin()) - 1;
  return (*stream_[k])[i - begins_[k]];
}

batch token_corpus::windows(const std::vector<std::size_t>& offsets, int seq_len) const {
  const auto n = std::int64_t(offsets.size());
  auto t = torch::empty({n, seq_len + 1}, torch::kInt64);
  auto* out = t.data_ptr<std::int64_t>();
  for (std::int64_t i = 0; i < n; ++i) {
    const std::size_t begin = offsets[std::size_t(i)];
    auto k = std::size_t(std::upper_bound(begins_.begin(), begins_.end(), begin) - begins_.begin()) - 1;
    for (int j = 0; j <= seq_len; ++j) {
      const std::size_t at = begin + std::size_t(j);
      while (at >= begins_[k] + stream_[k]->size()) ++k;  // the window goes on in the next file
      out[i * (seq_len + 1) + j] = (*stream_[k])[at - begins_[k]];
    }
  }
  batch b;
  b.input = t.narrow(1, 0, seq_len).contiguous();
  b.target = t.narrow(1, 1, seq_len).contiguous();
  return b;
}

batch token_corpus::train_batch(std::uint64_t seed, std::uint64_t first, int count, int seq_len) const {
  if (n_train_ <= std::size_t(seq_len) + 1)
    throw data_error("the training split holds " + std::to_string(n_train_) + " tokens: too few for seq_len " +
                     std::to_string(seq_len));
  std::vector<std::size_t> offsets(static_cast<std::size_t>(count));
  for (int i = 0; i < count; ++i)
    offsets[std::size_t(i)] = std::size_t(splitmix64(seeded_key(seed, first + std::uint64_t(i))) % (n_train_ - seq_len));
  return windows(offsets, seq_len);
}

batch token_corpus::validation_batch(int seq_len, const tokenizer* tok, int n_windows) const {
  if (n_valid_ < std::size_t(seq_len) + 1 + std::size_t(n_windows))
    throw data_error("the validation split holds " + std::to_string(n_valid_) + " tokens: too few for 32 windows of " +
                     std::to_string(seq_len));
  const std::size_t stride = (n_valid_ - seq_len - 1) / std::size_t(n_windows);
  std::vector<std::size_t> offsets(static_cast<std::size_t>(n_windows));
  for (int i = 0; i < n_windows; ++i) offsets[std::size_t(i)] = n_train_ + std::size_t(i) * stride;
  auto b = windows(offsets, seq_len);
  if (!tok) {  // (a Megatron dataset's ids without a tokenizer: their bytes are not known)
    b.bytes_per_target = 0;
    return b;
  }
  const auto bytes = tok->piece_bytes();
  std::int64_t total = 0;
  const auto* target = b.target.data_ptr<std::int64_t>();
  for (std::int64_t i = 0; i < b.target.numel(); ++i) {
    const auto id = std::size_t(target[i]);
    if (id >= bytes.size())
      throw data_error("token id " + std::to_string(id) + " of the validation data is past the tokenizer's " +
                       std::to_string(bytes.size()) + " ids");
    total += bytes[id];
  }
  b.bytes_per_target = double(total) / double(b.target.numel());
  return b;
}

}  // namespace troupe
