#pragma once
// The Python client environments of the tests that check Troupe against transformers,
// `tokenizers` and Megatron-Core: made on first use by the scripts of
// tests/support/python/ (pinned versions); "" where they cannot be made (no registry).
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "build_paths.hpp"

namespace troupe {

/// The python of a client environment, made on first use ("" where it cannot be made):
/// transformers 4.44.2 over Debian's torch 1.13 (hf_venv.sh, in the build folder), or
/// transformers 5 over torch 2 from Python's package registry (hf5_venv.sh: 5.6 GB, so in
/// the user's cache, made once per machine).
inline std::string make_python(const std::string& script, const std::string& venv) {
  const std::string cmd = std::string(troupe::test::source_dir) + "/tests/support/python/" + script + " " + venv;
  std::string out;
  if (FILE* p = ::popen(cmd.c_str(), "r")) {
    char buf[512];
    while (std::fgets(buf, sizeof buf, p)) out += buf;
    if (::pclose(p) != 0) return std::string();
  }
  while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
  return out;
}

inline const std::string& hf_python(int major = 4) {
  static const std::string v4 =
      make_python("hf_venv.sh", std::filesystem::path(troupe::test::troupe_binary).parent_path() / "hf-venv");
  if (major == 4) return v4;
  static const std::string v5 = [] {
    const char* xdg = std::getenv("XDG_CACHE_HOME");
    const char* home = std::getenv("HOME");
    const std::filesystem::path cache = xdg && *xdg ? xdg : std::string(home ? home : "/tmp") + "/.cache";
    return make_python("hf5_venv.sh", cache / "troupe" / "hf5-venv");
  }();
  return v5;
}

}  // namespace troupe
