#pragma once
// A fresh temporary folder for a test or benchmark, removed with the object.
#include <cstdlib>
#include <filesystem>
#include <string>

#include "compute/runtime/remove_tree.hpp"

namespace troupe::test {

/// A fresh temporary folder, removed with the object.
struct temp_dir {
  std::filesystem::path path;
  temp_dir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "troupe-test-XXXXXX").string();
    path = mkdtemp(tmpl.data());
  }
  ~temp_dir() { remove_tree(path.string()); }
  std::string operator/(const std::string& name) const { return (path / name).string(); }
};

}  // namespace troupe::test
