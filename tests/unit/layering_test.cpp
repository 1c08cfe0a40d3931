// The layers of docs/architecture.md, checked on the sources: compute/ never includes CAF
// (nor the layers above it), transport/ knows neither models nor actors, messages/
// depends only on CAF and LibTorch.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <vector>

namespace {

/// "FILE: #include LINE" for every include of the layer's files that `forbidden` matches.
std::vector<std::string> violations(const std::string& layer, const std::regex& forbidden) {
  std::vector<std::string> out;
  const std::filesystem::path root = std::string(TROUPE_SOURCE_DIR) + "/" + layer;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(root)) {
    const auto ext = entry.path().extension();
    if (ext != ".hpp" && ext != ".cpp") continue;
    std::ifstream in(entry.path());
    for (std::string line; std::getline(in, line);)
      if (line.rfind("#include", 0) == 0 && std::regex_search(line, forbidden))
        out.push_back(entry.path().lexically_relative(TROUPE_SOURCE_DIR).string() + ": " + line);
  }
  return out;
}

std::string listed(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += "\n  " + x;
  return s;
}

}  // namespace

TEST(Layering, ComputeIncludesNeitherCafNorTheLayersAboveIt) {
  const auto bad = violations("compute", std::regex(R"(<caf/|"(actors|messages|transport|launch)/)"));
  EXPECT_TRUE(bad.empty()) << listed(bad);
}

TEST(Layering, TransportKnowsNeitherModelsNorActors) {
  const auto bad = violations("transport", std::regex(R"(<caf/|"(actors|messages|compute|launch)/)"));
  EXPECT_TRUE(bad.empty()) << listed(bad);
}

TEST(Layering, MessagesDependOnlyOnCafAndLibTorch) {
  const auto bad = violations("messages", std::regex(R"("(actors|compute|transport|launch)/)"));
  EXPECT_TRUE(bad.empty()) << listed(bad);
}

// No environment variable is read below launch/ (launch/environment.hpp reads them once
// into launch_info and the UCX options), except the settings of other libraries that
// Troupe must not contradict: cuBLAS's workspace for deterministic runs, glibc malloc's
// tunables.
TEST(Layering, NoEnvironmentVariableIsReadBelowLaunch) {
  std::vector<std::string> bad;
  for (const char* layer : {"actors", "compute", "transport", "messages"}) {
    const std::filesystem::path root = std::string(TROUPE_SOURCE_DIR) + "/" + layer;
    for (const auto& entry : std::filesystem::recursive_directory_iterator(root)) {
      const auto ext = entry.path().extension();
      if (ext != ".hpp" && ext != ".cpp") continue;
      std::ifstream in(entry.path());
      for (std::string line; std::getline(in, line);)
        if (line.find("getenv(") != std::string::npos && line.find("CUBLAS_WORKSPACE_CONFIG") == std::string::npos &&
            line.find("std::getenv(user)") == std::string::npos)
          bad.push_back(entry.path().lexically_relative(TROUPE_SOURCE_DIR).string() + ": " + line);
    }
  }
  EXPECT_TRUE(bad.empty()) << listed(bad);
}

TEST(Layering, TheCheckFindsAnInclude) {  // the checks above can fail
  EXPECT_FALSE(violations("actors", std::regex(R"("messages/type_ids.hpp")")).empty());
}
