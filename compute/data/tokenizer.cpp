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

#include <dlfcn.h>

#include "compute/runtime/file_bytes.hpp"
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

}  // namespace

tokenizer::tokenizer(const std::string& path) : path_(path) {
  if (!fs::is_regular_file(path)) throw data_error("tokenizer " + path + " does not exist (or is not a file)");
  std::vector<char> bytes;
  try {
    bytes = read_file_bytes(path);
  } catch (const std::exception& e) {
    throw data_error("tokenizer " + path + ": " + e.what());
  }
  std::string error;
  sp_ = spm().load(std::string(bytes.begin(), bytes.end()), error);
  if (!sp_)
    throw data_error("tokenizer " + path + " is not a SentencePiece model (" + error + "): make one with troupe tokenizer");
  fingerprint_ = std::to_string(size()) + " pieces, fnv1a " + hex64(fnv1a(bytes.data(), bytes.size()));
}

tokenizer::~tokenizer() {
  if (sp_) spm().release(sp_);
}

int tokenizer::size() const { return spm().size(sp_); }

std::vector<int> tokenizer::encode(const std::string& text) const {
  std::vector<int> ids;
  std::string error;
  if (!spm().encode(sp_, text, ids, error)) throw data_error("tokenizer " + path_ + " cannot encode: " + error);
  return ids;
}

std::string tokenizer::decode(const std::vector<int>& ids) const {
  std::string text, error;
  if (!spm().decode(sp_, ids, text, error)) throw data_error("tokenizer " + path_ + " cannot decode: " + error);
  return text;
}

std::vector<std::int32_t> tokenizer::piece_bytes() const {
  std::vector<std::int32_t> out(std::size_t(size()), 0);
  static const std::string space = "\xe2\x96\x81";  // U+2581, the space a piece stands for
  for (int id = 0; id < size(); ++id) {
    const int kind = spm().kind(sp_, id);
    if (kind == 1) continue;  // control: no bytes
    if (kind == 2) {          // <0xNN>
      out[std::size_t(id)] = 1;
      continue;
    }
    const auto& piece = *spm().piece(sp_, id);
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
    it = known.emplace(path, tokenizer_info{tok.size(), tok.fingerprint()}).first;
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

token_corpus::token_corpus(const text_corpus& text, const std::string& text_fingerprint, const tokenizer& tok,
                           const std::string& cache_dir) {
  const std::string identity = "text " + text_fingerprint + "; tokenizer " + tok.fingerprint();
  const std::uint64_t fingerprint = fnv1a(identity.data(), identity.size());
  const fs::path dir = cache_dir.empty() ? fs::path(default_cache_dir()) : fs::path(cache_dir);
  file_ = (dir / ("tokens-" + hex64(fingerprint) + ".bin")).string();
  if (!fs::exists(file_)) {  // encode once: the splits, each as one string
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
    write_file_atomically(file_, [&](const byte_sink& sink) {
      sink(reinterpret_cast<const char*>(&h), sizeof h);
      static_assert(sizeof(int) == sizeof(std::int32_t), "token ids are 32-bit");
      sink(reinterpret_cast<const char*>(train.data()), train.size() * 4);
      sink(reinterpret_cast<const char*>(valid.data()), valid.size() * 4);
    });
    written_ = true;
  }
  const int fd = ::open(file_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw data_error("cannot open the token cache " + file_ + ": " + std::strerror(errno));
  struct stat st {};
  ::fstat(fd, &st);
  mapped_ = std::size_t(st.st_size);
  cache_header h{};
  if (mapped_ < sizeof h || ::pread(fd, &h, sizeof h, 0) != ssize_t(sizeof h) || std::memcmp(h.magic, cache_magic, 8) != 0 ||
      h.fingerprint != fingerprint || mapped_ != sizeof h + 4 * (h.n_train + h.n_valid)) {
    ::close(fd);
    throw data_error("token cache " + file_ + " is not the cache of this text and tokenizer (a fingerprint or " +
                     "size that disagrees): remove it and run again");
  }
  map_ = ::mmap(nullptr, mapped_, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (map_ == MAP_FAILED) {
    map_ = nullptr;
    throw data_error("cannot map the token cache " + file_ + ": " + std::strerror(errno));
  }
  ids_ = reinterpret_cast<const std::int32_t*>(static_cast<const char*>(map_) + sizeof h);
  n_train_ = h.n_train;
  n_valid_ = h.n_valid;
}

token_corpus::~token_corpus() {
  if (map_) ::munmap(map_, mapped_);
}

batch token_corpus::windows(const std::vector<std::size_t>& offsets, int seq_len) const {
  const auto n = std::int64_t(offsets.size());
  auto t = torch::empty({n, seq_len + 1}, torch::kInt64);
  auto* out = t.data_ptr<std::int64_t>();
  for (std::int64_t i = 0; i < n; ++i)
    for (int j = 0; j <= seq_len; ++j) out[i * (seq_len + 1) + j] = ids_[offsets[std::size_t(i)] + std::size_t(j)];
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

batch token_corpus::validation_batch(int seq_len, const tokenizer& tok, int n_windows) const {
  if (n_valid_ < std::size_t(seq_len) + 1 + std::size_t(n_windows))
    throw data_error("the validation split holds " + std::to_string(n_valid_) + " tokens: too few for 32 windows of " +
                     std::to_string(seq_len));
  const std::size_t stride = (n_valid_ - seq_len - 1) / std::size_t(n_windows);
  std::vector<std::size_t> offsets(static_cast<std::size_t>(n_windows));
  for (int i = 0; i < n_windows; ++i) offsets[std::size_t(i)] = n_train_ + std::size_t(i) * stride;
  auto b = windows(offsets, seq_len);
  const auto bytes = tok.piece_bytes();
  std::int64_t total = 0;
  const auto* target = b.target.data_ptr<std::int64_t>();
  for (std::int64_t i = 0; i < b.target.numel(); ++i) total += bytes.at(std::size_t(target[i]));
  b.bytes_per_target = double(total) / double(b.target.numel());
  return b;
}

}  // namespace troupe
