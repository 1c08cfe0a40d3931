#include "compute/checkpoint.hpp"
#include "compute/torch_file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <sstream>

#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickler.h>

namespace troupe {

namespace {
[[noreturn]] void fail(const std::string& what, const std::string& path) {
  throw checkpoint_error(what + " " + path + ": " + std::strerror(errno));
}
}  // namespace

void write_file_atomically(const std::string& path, const std::string& bytes) {
  write_file_atomically(path, [&](const byte_sink& sink) { sink(bytes.data(), bytes.size()); });
}

namespace {

/// `produce`'s bytes in a new temporary file beside `path`, synced; returns its name.
/// Throws checkpoint_error (no temporary file left).
std::string write_temporary(const std::string& path, const std::function<void(const byte_sink&)>& produce) {
  namespace fs = std::filesystem;
  const fs::path target(path);
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  std::string tmp = (dir / ("." + target.filename().string() + ".tmp.XXXXXX")).string();
  int fd = mkstemp(tmp.data());
  if (fd < 0) fail("cannot create a temporary file for", path);
  int write_errno = 0;  // the first failed write's; later pieces are dropped
  auto sink = [&](const char* data, std::size_t n) {
    std::size_t written = 0;
    while (write_errno == 0 && written < n) {
      const auto w = ::write(fd, data + written, n - written);
      if (w < 0 && errno == EINTR) continue;
      if (w < 0) write_errno = errno;
      else written += std::size_t(w);
    }
  };
  auto give_up = [&](const char* what) {
    const int e = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    errno = e;
    fail(what, tmp);
  };
  try {
    produce(sink);
  } catch (...) {
    if (write_errno == 0) {  // the producer's own failure
      ::close(fd);
      ::unlink(tmp.c_str());
      throw;
    }
  }
  if (write_errno != 0) {
    errno = write_errno;
    give_up("cannot write");
  }
  if (::fchmod(fd, 0644) != 0 || ::fsync(fd) != 0) give_up("cannot sync");
  ::close(fd);
  return tmp;
}

/// Renames the temporary file `tmp` to `path` (removing `tmp` if that fails). Throws
/// checkpoint_error.
void rename_into_place(const std::string& tmp, const std::string& path) {
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int e = errno;
    ::unlink(tmp.c_str());
    errno = e;
    fail("cannot rename into", path);
  }
}

/// Makes the renames in `path`'s folder durable.
void sync_folder_of(const std::string& path) {
  namespace fs = std::filesystem;
  const fs::path target(path);
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

constexpr const char* pair_record = "troupe_save_pair";

}  // namespace

void write_file_atomically(const std::string& path, const std::function<void(const byte_sink&)>& produce) {
  rename_into_place(write_temporary(path, produce), path);
  sync_folder_of(path);
}

void save_state_dict_pair(const std::string& path, const state_dict& model, const state_dict& optim,
                          std::int64_t step) {
  std::random_device rd;
  char id[40];
  std::snprintf(id, sizeof id, "%08x%08x%08x", rd(), rd(), rd());
  const std::vector<std::pair<std::string, std::string>> mark{
      {pair_record, "step " + std::to_string(step) + "\nid " + id + "\n"}};
  const auto optim_tmp =
      write_temporary(path + ".optim", [&](const byte_sink& sink) { write_state_dict(optim, sink, mark); });
  std::string model_tmp;
  try {
    model_tmp = write_temporary(path, [&](const byte_sink& sink) { write_state_dict(model, sink, mark); });
  } catch (...) {
    ::unlink(optim_tmp.c_str());
    throw;
  }
  try {
    rename_into_place(optim_tmp, path + ".optim");
  } catch (...) {
    ::unlink(model_tmp.c_str());
    throw;
  }
  try {
    rename_into_place(model_tmp, path);
  } catch (const checkpoint_error& e) {
    sync_folder_of(path);
    throw mixed_pair_error(std::string(e.what()) + ", after " + path +
                           ".optim was replaced: the two files are now of different saves (--load refuses them)");
  }
  sync_folder_of(path);
}

pair_mark read_pair_mark(const std::vector<char>& bytes) {
  pair_mark m;
  std::istringstream in(read_torch_record(bytes, pair_record));
  std::string key;
  while (in >> key) {
    if (key == "step" && !(in >> m.step)) return {};
    if (key == "id" && !(in >> m.id)) return {};
  }
  if (m.id.empty()) return {};
  return m;
}

void save_state_dict(const std::string& path, const state_dict& state) {
  write_file_atomically(path, [&](const byte_sink& sink) { write_state_dict(state, sink); });
}

void write_state_dict(const state_dict& state, const byte_sink& sink,
                      const std::vector<std::pair<std::string, std::string>>& records) {
  c10::Dict<std::string, torch::Tensor> dict;
  for (const auto& [name, t] : state) dict.insert(name, t.detach().contiguous());
  // What torch::jit::pickle_save writes (torch.save's zip format), but with the dict
  // pickled as a plain dict: pickle_save tags it with torch.jit._pickle.restore_type_tag,
  // which torch.load's default weights_only=True (PyTorch >= 2.6) refuses to unpickle.
  std::vector<char> pickled;
  torch::jit::Pickler pickler([&](const char* p, std::size_t n) { pickled.insert(pickled.end(), p, p + n); },
                              nullptr, nullptr, nullptr, nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(c10::IValue(dict));
  pickler.stop();
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* p, std::size_t n) {
    sink(static_cast<const char*>(p), n);
    return n;
  });
  torch::jit::writeArchiveAndTensors("data", pickled.data(), pickled.size(), pickler.tensorData(), writer);
  for (const auto& [name, text] : records) writer.writeRecord(name, text.data(), text.size());
  writer.writeEndOfFile();
}

std::vector<char> read_file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) throw checkpoint_error("cannot open checkpoint " + path + ": " + std::strerror(errno));
  if (!std::filesystem::is_regular_file(path)) throw checkpoint_error("checkpoint " + path + " is not a file");
  std::vector<char> bytes(static_cast<std::size_t>(in.tellg()));
  in.seekg(0);
  if (!in.read(bytes.data(), std::streamsize(bytes.size())))
    throw checkpoint_error("cannot read checkpoint " + path + ": " + std::strerror(errno));
  return bytes;
}

state_dict load_state_dict(const std::string& path) { return load_state_dict(read_file_bytes(path), path); }

state_dict load_state_dict(const std::vector<char>& bytes, const std::string& path) {
  if (bytes.empty()) throw checkpoint_error("checkpoint " + path + " is empty");
  try {
    return read_torch_state_dict(bytes);
  } catch (const c10::Error& e) {  // LibTorch's zip reader
    std::string msg = e.what();
    throw checkpoint_error("checkpoint " + path + " is not a readable PyTorch file (" + msg.substr(0, msg.find('\n')) + ")");
  } catch (const std::runtime_error& e) {
    throw checkpoint_error("checkpoint " + path + " is not a readable PyTorch file: " + e.what());
  }
}

}  // namespace troupe
