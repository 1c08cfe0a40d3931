#pragma once
// Recursive removal without std::filesystem::remove_all. PyTorch 2.x's libtorch.so exports
// its own copy of remove_all (statically linked libstdc++ parts of its toolchain, among
// them recursive_directory_iterator: pytorch/pytorch#133437); the dynamic linker binds
// our calls to it and that copy crashes (a call through a null pointer, seen with PyTorch
// 2.11 on the GPU machine). Header-only, no LibTorch: tests and benchmarks of every layer
// use it.
#include <ftw.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstdio>
#include <string>

namespace troupe {

/// Removes a file or a folder with everything in it (symbolic links are removed, not
/// followed); a missing path is no error. Returns false if something could not be removed.
inline bool remove_tree(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return errno == ENOENT;
  static thread_local bool ok;  // nftw's callback takes no context
  ok = true;
  const auto remove_one = [](const char* p, const struct stat*, int, struct FTW*) -> int {
    if (std::remove(p) != 0 && errno != ENOENT) ok = false;
    return 0;  // go on: remove what can be removed
  };
  if (::nftw(path.c_str(), remove_one, 16, FTW_DEPTH | FTW_PHYS) != 0) return false;
  return ok;
}

}  // namespace troupe
