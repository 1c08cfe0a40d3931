#include "compute/runtime/file_bytes.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

namespace troupe {

namespace {
[[noreturn]] void fail(const std::string& what, const std::string& path) {
  throw checkpoint_error(what + " " + path + ": " + std::strerror(errno));
}
}  // namespace

void write_file_atomically(const std::string& path, const std::string& bytes) {
  write_file_atomically(path, [&](const byte_sink& sink) { sink(bytes.data(), bytes.size()); });
}

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

void rename_into_place(const std::string& tmp, const std::string& path) {
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int e = errno;
    ::unlink(tmp.c_str());
    errno = e;
    fail("cannot rename into", path);
  }
}

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

void write_file_atomically(const std::string& path, const std::function<void(const byte_sink&)>& produce) {
  rename_into_place(write_temporary(path, produce), path);
  sync_folder_of(path);
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

}  // namespace troupe
