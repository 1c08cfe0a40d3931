#include "compute/data/data.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>

#include <spdlog/spdlog.h>

#include "compute/runtime/splitmix.hpp"

namespace fs = std::filesystem;

namespace troupe {

// --- fortunes ------------------------------------------------------------------------

namespace {

/// The sizes of `files` (`what` names them in errors).
std::vector<std::uint64_t> file_sizes(const std::vector<std::string>& files, const std::string& what) {
  std::vector<std::uint64_t> sizes;
  for (const auto& file : files) {
    std::error_code ec;
    sizes.push_back(fs::file_size(file, ec));
    if (ec) throw data_error("cannot read " + file + " (" + what + "): " + ec.message());
  }
  return sizes;
}

/// Throws data_error unless `files` hold `need` bytes or more (`why` says what for; when
/// they hold none, `empty_hint` follows "is empty"); their size.
std::uint64_t require_bytes(const std::vector<std::string>& files, const std::string& what, std::uint64_t need,
                            int seq_len, const std::string& why, const std::string& empty_hint = "") {
  const auto sizes = file_sizes(files, what);
  const auto total = std::accumulate(sizes.begin(), sizes.end(), std::uint64_t{0});
  if (total == 0) throw data_error(what + " is empty" + empty_hint);
  if (total < need)
    throw data_error(what + " holds " + std::to_string(total) + " bytes: too few for seq_len " +
                     std::to_string(seq_len) + ", which needs at least " + std::to_string(need) + " (" + why + ")");
  return total;
}

}  // namespace

void text_corpus::require(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    throw data_error("fortunes corpus not found: " + dir + " does not exist (install it: apt-get install fortunes)");
}

std::vector<std::string> text_corpus::fortunes_files(const std::string& dir) {
  require(dir);
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const auto name = entry.path().filename().string();
    if (entry.is_symlink() || !entry.is_regular_file()) continue;
    if (name.find('.') != std::string::npos) continue;  // *.dat, *.u8, ...
    names.push_back(name);
  }
  std::sort(names.begin(), names.end());  // byte order, as LC_ALL=C sort
  for (auto& name : names) name = (fs::path(dir) / name).string();
  return names;
}

/// What a corpus's segments point into: its file mappings and the buffers it was given.
struct text_corpus::storage {
  std::vector<std::pair<void*, std::size_t>> mappings;
  std::vector<std::vector<std::uint8_t>> buffers;
  storage() = default;
  storage(const storage&) = delete;
  storage& operator=(const storage&) = delete;
  ~storage() {
    for (const auto& [addr, size] : mappings) ::munmap(addr, size);
  }
};

void text_corpus::add(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return;
  segments_.push_back({size_, data, size});
  size_ += size;
}

void text_corpus::add_buffer(std::vector<std::uint8_t> bytes) {
  if (bytes.empty()) return;
  storage_->buffers.push_back(std::move(bytes));  // the vector's heap block stays where it is
  add(storage_->buffers.back().data(), storage_->buffers.back().size());
}

namespace {

/// The rest of open file `fd` from its current offset, read to its end (not trusting the
/// size fstat gave: a file of a special file system may hold more or less).
std::vector<std::uint8_t> read_all(int fd, std::size_t size_hint, const std::string& file, const std::string& what) {
  std::vector<std::uint8_t> out(size_hint + 1);  // one more: the end shows without growing
  std::size_t got = 0;
  for (;;) {
    if (got == out.size()) out.resize(out.size() * 2);
    const auto n = ::read(fd, out.data() + got, out.size() - got);
    if (n == 0) break;
    if (n < 0) {
      if (errno == EINTR) continue;
      throw data_error("cannot read " + file + " (" + what + "): " + std::strerror(errno));
    }
    got += std::size_t(n);
  }
  out.resize(got);
  if (out.capacity() > got + got / 8) out.shrink_to_fit();  // a file that grew: no double buffer kept
  return out;
}

std::atomic<bool> no_mapping{false};  // text_corpus::fail_mappings_for_testing

}  // namespace

void text_corpus::fail_mappings_for_testing(bool fail) { no_mapping.store(fail); }

void text_corpus::map_files(const std::vector<std::string>& files, const std::string& what) {
  struct closer {  // the file is closed however this iteration ends (a mapping keeps it)
    int fd;
    ~closer() { ::close(fd); }
  };
  for (const auto& file : files) {
    const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw data_error("cannot read " + file + " (" + what + "): " + std::strerror(errno));
    const closer close_it{fd};
    struct stat st {};
    if (::fstat(fd, &st) != 0) throw data_error("cannot read " + file + " (" + what + "): " + std::strerror(errno));
    const auto size = static_cast<std::size_t>(st.st_size);
    if (size == 0) continue;
    void* addr = MAP_FAILED;
    int err = ENODEV;  // TROUPE_TEXT_NO_MMAP
    if (!no_mapping.load()) {
      addr = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
      err = errno;
    }
    if (addr == MAP_FAILED) {
      // A file system that cannot map files (some FUSE and network mounts): the file is
      // read into memory instead, a copy in this process.
      spdlog::warn("cannot map {} ({}) into memory ({}): reading its {} bytes into memory instead", file, what,
                   std::strerror(err), size);
      add_buffer(read_all(fd, size, file, what));
      continue;
    }
    storage_->mappings.emplace_back(addr, size);
    add(static_cast<const std::uint8_t*>(addr), size);
    mapped_ += size;
  }
}

void text_corpus::copy(std::size_t begin, std::size_t n, std::uint8_t* out) const {
  if (n == 0) return;
  if (begin > size_ || n > size_ - begin)
    throw data_error("bytes " + std::to_string(begin) + " to " + std::to_string(begin + n) + " are past the end of a " +
                     std::to_string(size_) + "-byte text corpus");
  // The segment holding `begin`: the last one that starts at or before it.
  auto it = std::upper_bound(segments_.begin(), segments_.end(), begin,
                             [](std::size_t at, const segment& s) { return at < s.begin; });
  for (--it; n > 0; ++it) {
    const std::size_t from = begin - it->begin;
    const std::size_t take = std::min(n, it->size - from);
    std::memcpy(out, it->data + from, take);
    out += take;
    begin += take;
    n -= take;
  }
}

std::vector<std::uint8_t> text_corpus::bytes(std::size_t begin, std::size_t count) const {
  begin = std::min(begin, size_);
  std::vector<std::uint8_t> out(std::min(count, size_ - begin));
  copy(begin, out.size(), out.data());
  return out;
}

text_corpus::text_corpus(const std::string& dir) : storage_(std::make_shared<storage>()) {
  map_files(fortunes_files(dir), "fortunes corpus " + dir);
  if (size_ == 0) throw data_error("fortunes corpus in " + dir + " is empty (install it: apt-get install fortunes)");
  n_train_ = size_ * 9 / 10;
}

text_corpus::text_corpus(std::vector<std::uint8_t> bytes) : storage_(std::make_shared<storage>()) {
  add_buffer(std::move(bytes));
  n_train_ = size_ * 9 / 10;
}

std::vector<std::string> text_corpus::text_files(const std::string& path) {
  std::error_code ec;
  const auto status = fs::status(path, ec);
  if (ec || !fs::exists(status)) throw data_error("text corpus not found: " + path + " does not exist");
  if (fs::is_regular_file(status)) return {path};
  if (!fs::is_directory(status)) throw data_error("text corpus " + path + " is neither a file nor a folder");
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(path, ec)) {
    const auto name = entry.path().filename().string();
    if (name.empty() || name[0] == '.' || !entry.is_regular_file(ec)) continue;
    names.push_back(name);
  }
  if (ec) throw data_error("cannot list the text corpus folder " + path + ": " + ec.message());
  if (names.empty()) throw data_error("text corpus folder " + path + " holds no files");
  std::sort(names.begin(), names.end());  // byte order, as LC_ALL=C sort
  for (auto& name : names) name = (fs::path(path) / name).string();
  return names;
}

text_corpus::text_corpus(std::vector<std::uint8_t> train, const std::vector<std::uint8_t>& valid)
    : storage_(std::make_shared<storage>()) {
  add_buffer(std::move(train));
  n_train_ = size_;
  add_buffer(valid);
}

text_corpus text_corpus::read_text(const std::string& train, const std::string& valid) {
  text_corpus c(std::vector<std::uint8_t>{});
  c.map_files(text_files(train), "text corpus " + train);
  if (c.size_ == 0) throw data_error("text corpus " + train + " is empty");
  c.n_train_ = c.size_;
  c.map_files(text_files(valid), "validation text " + valid);
  if (c.size_ == c.n_train_) throw data_error("validation text " + valid + " is empty");
  return c;
}

text_corpus text_corpus::read_text(const std::string& path) {
  text_corpus c(std::vector<std::uint8_t>{});
  c.map_files(text_files(path), "text corpus " + path);
  if (c.size_ == 0) throw data_error("text corpus " + path + " is empty");
  c.n_train_ = c.size_ * 9 / 10;
  return c;
}

std::size_t text_corpus::min_bytes(int seq_len) {
  const std::size_t window = std::size_t(seq_len) + 1;
  for (std::size_t n = 10 * (window + 32) - 20;; ++n)
    if (n * 9 / 10 > window && n - n * 9 / 10 >= window + 32) return n;
}

std::size_t text_corpus::require_size(const std::vector<std::string>& files, const std::string& what, int seq_len,
                                      const std::string& empty_hint) {
  return require_bytes(files, what, min_bytes(seq_len), seq_len,
                       "a training window in the first 90 %, 32 validation windows in the rest", empty_hint);
}

void text_corpus::require_sizes(const std::vector<std::string>& train, const std::string& train_what,
                                const std::vector<std::string>& valid, const std::string& valid_what, int seq_len) {
  const std::uint64_t window = std::uint64_t(seq_len) + 1;
  require_bytes(train, train_what, window + 1, seq_len, "a training window");
  require_bytes(valid, valid_what, window + 32, seq_len, "32 validation windows");
}

std::size_t text_corpus::train_offset(std::uint64_t seed, std::uint64_t g, int seq_len) const {
  if (n_train_ <= static_cast<std::size_t>(seq_len) + 1)
    throw data_error("text corpus of " + std::to_string(size()) + " bytes too small for seq_len " +
                     std::to_string(seq_len) + " (needs at least " + std::to_string(min_bytes(seq_len)) + ")");
  return splitmix64(seeded_key(seed, g)) % (n_train_ - seq_len);
}

batch text_corpus::windows(const std::vector<std::size_t>& offsets, int seq_len) const {
  const auto n = static_cast<std::int64_t>(offsets.size());
  auto input = torch::empty({n, seq_len}, torch::kInt64);
  auto target = torch::empty({n, seq_len}, torch::kInt64);
  auto in = input.accessor<std::int64_t, 2>();
  auto tg = target.accessor<std::int64_t, 2>();
  std::vector<std::uint8_t> window(std::size_t(seq_len) + 1);
  for (std::int64_t i = 0; i < n; ++i) {
    copy(offsets[i], window.size(), window.data());
    const std::uint8_t* w = window.data();
    for (int t = 0; t < seq_len; ++t) {
      in[i][t] = w[t];
      tg[i][t] = w[t + 1];
    }
  }
  return {input, target, {}};
}

batch text_corpus::train_batch(std::uint64_t seed, std::uint64_t first, int count,
                                   int seq_len) const {
  std::vector<std::size_t> offsets(count);
  for (int i = 0; i < count; ++i) offsets[i] = train_offset(seed, first + i, seq_len);
  return windows(offsets, seq_len);
}

batch text_corpus::validation_batch(int seq_len, int n_windows) const {
  if (n_valid() < static_cast<std::size_t>(seq_len) + 1 + n_windows)
    throw data_error("text corpus of " + std::to_string(size()) + " bytes: its validation split (the last 10 %) is " +
                     "too small for seq_len " + std::to_string(seq_len) + " (needs at least " +
                     std::to_string(min_bytes(seq_len)) + " bytes in all)");
  const std::size_t stride = (n_valid() - seq_len - 1) / n_windows;
  std::vector<std::size_t> offsets(n_windows);
  for (int i = 0; i < n_windows; ++i) offsets[i] = n_train_ + i * stride;
  return windows(offsets, seq_len);
}

// --- Fashion-MNIST -------------------------------------------------------------------

namespace {

std::uint32_t read_be32(gzFile f, const std::string& path) {
  unsigned char b[4];
  if (gzread(f, b, 4) != 4) throw data_error("truncated IDX header in " + path);
  return (std::uint32_t(b[0]) << 24) | (std::uint32_t(b[1]) << 16) | (std::uint32_t(b[2]) << 8) | b[3];
}

constexpr const char* idx_files[] = {"train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
                                     "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"};

/// Reads an IDX file of unsigned bytes: magic 0x0803 (images) or 0x0801 (labels).
torch::Tensor read_idx(const std::string& path, int expected_dims) {
  gzFile f = gzopen(path.c_str(), "rb");
  if (!f) throw data_error("cannot open " + path);
  std::unique_ptr<gzFile_s, int (*)(gzFile)> guard(f, gzclose);
  const auto magic = read_be32(f, path);
  if ((magic >> 8) != 0x08 || static_cast<int>(magic & 0xff) != expected_dims)
    throw data_error("not an IDX file of unsigned bytes with " + std::to_string(expected_dims) +
                     " dimensions: " + path);
  std::vector<std::int64_t> dims;
  std::int64_t total = 1;
  for (int i = 0; i < expected_dims; ++i) {
    dims.push_back(read_be32(f, path));
    total *= dims.back();
  }
  auto out = torch::empty(dims, torch::kUInt8);
  if (gzread(f, out.data_ptr<std::uint8_t>(), static_cast<unsigned>(total)) != total)
    throw data_error("truncated IDX data in " + path);
  return out;
}

torch::Tensor normalise(const torch::Tensor& images) {
  auto x = images.to(torch::kFloat32).div_(255.0).reshape({images.size(0), fashion_mnist::image_size});
  return x.sub_(fashion_mnist::mean).div_(fashion_mnist::stddev);
}

}  // namespace

void fashion_mnist::require(const std::string& dir) {
  std::error_code ec;
  for (const auto& file : files(dir))
    if (!fs::exists(file, ec))
      throw data_error("Fashion-MNIST file not found: " + file + " (install it: apt-get install dataset-fashion-mnist)");
}

std::vector<std::string> fashion_mnist::files(const std::string& dir) {
  std::vector<std::string> out;
  for (const char* f : idx_files) out.push_back((fs::path(dir) / f).string());
  return out;
}

fashion_mnist::fashion_mnist(const std::string& dir, bool training_set, bool test_set) {
  require(dir);
  const auto paths = files(dir);
  const auto file = [&](int i) { return paths.at(i); };
  if (training_set) {
    train_images_ = normalise(read_idx(file(0), 3));
    train_labels_ = read_idx(file(1), 1).to(torch::kInt64);
    if (train_images_.size(0) != train_labels_.size(0))
      throw data_error("Fashion-MNIST training images and labels disagree in count in " + dir);
  }
  if (test_set) {
    test_images_ = normalise(read_idx(file(2), 3));
    test_labels_ = read_idx(file(3), 1).to(torch::kInt64);
    if (test_images_.size(0) != test_labels_.size(0))
      throw data_error("Fashion-MNIST test images and labels disagree in count in " + dir);
  }
}

int fashion_mnist::train_size() const {
  if (!train_labels_.defined()) throw data_error("the Fashion-MNIST training set was not loaded");
  return static_cast<int>(train_labels_.size(0));
}

int fashion_mnist::test_size() const {
  if (!test_labels_.defined()) throw data_error("the Fashion-MNIST test set was not loaded");
  return static_cast<int>(test_labels_.size(0));
}

batch fashion_mnist::test_set() const {
  test_size();  // (throws when not loaded)
  return {test_images_, test_labels_, {}};
}

std::vector<std::int64_t> fashion_mnist::epoch_order(std::uint64_t seed, std::uint64_t epoch) const {
  const auto n = train_size();
  std::vector<std::pair<std::uint64_t, std::int64_t>> keyed(n);
  for (std::int64_t i = 0; i < n; ++i)
    keyed[i] = {splitmix64(seeded_key(seed, (epoch << 20) + i)), i};
  std::sort(keyed.begin(), keyed.end());  // ties broken by index
  std::vector<std::int64_t> order(n);
  for (std::int64_t i = 0; i < n; ++i) order[i] = keyed[i].second;
  return order;
}

batch fashion_mnist::train_batch(const std::vector<std::int64_t>& order, std::int64_t first,
                                 int count) const {
  auto idx = torch::from_blob(const_cast<std::int64_t*>(order.data() + first), {count}, torch::kInt64);
  return {train_images_.index_select(0, idx), train_labels_.index_select(0, idx), {}};
}

torch::Tensor document_positions(const torch::Tensor& ids, std::int64_t eos) {
  const auto T = ids.size(1);
  const auto index = torch::arange(T, ids.options().dtype(torch::kInt64)).expand({ids.size(0), T});
  // Token t starts a document when t = 0 or token t - 1 is EOS; its position is t minus
  // the index of the last start at or before it.
  auto starts = torch::zeros_like(index, torch::kBool);
  starts.select(1, 0).fill_(true);
  if (T > 1) starts.narrow(1, 1, T - 1).copy_(ids.narrow(1, 0, T - 1).eq(eos));
  const auto last_start = std::get<0>(torch::cummax(index * starts.to(torch::kInt64), /*dim=*/1));
  return index - last_start;
}

}  // namespace troupe
