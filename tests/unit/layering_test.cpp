// The layers of docs/architecture.md, checked on the sources: compute/ never includes CAF
// (nor the layers above it), transport/ knows neither models nor actors, messages/
// depends only on CAF and LibTorch.
#include <gtest/gtest.h>

#include <filesystem>
#include <functional>
#include <fstream>
#include <regex>
#include <string>
#include <vector>
#include "build_paths.hpp"

namespace {

/// "FILE: LINE" for every line of the layer's sources that `wanted` picks.
std::vector<std::string> lines_of(const std::string& layer, const std::function<bool(const std::string&)>& wanted) {
  std::vector<std::string> out;
  const std::filesystem::path root = std::string(troupe::test::source_dir) + "/" + layer;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(root)) {
    const auto ext = entry.path().extension();
    if (ext != ".hpp" && ext != ".cpp") continue;
    std::ifstream in(entry.path());
    for (std::string line; std::getline(in, line);)
      if (wanted(line)) out.push_back(entry.path().lexically_relative(troupe::test::source_dir).string() + ": " + line);
  }
  return out;
}

/// Every include of the layer's files that `forbidden` matches.
std::vector<std::string> violations(const std::string& layer, const std::regex& forbidden) {
  return lines_of(layer, [&](const std::string& line) {
    return line.rfind("#include", 0) == 0 && std::regex_search(line, forbidden);
  });
}

/// Every line of the layer's files that calls getenv.
std::vector<std::string> environment_reads(const std::string& layer) {
  return lines_of(layer, [](const std::string& line) { return line.find("getenv(") != std::string::npos; });
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
  for (const char* layer : {"actors", "compute", "transport", "messages"})
    for (const auto& line : environment_reads(layer))
      if (line.find("CUBLAS_WORKSPACE_CONFIG") == std::string::npos && line.find("std::getenv(user)") == std::string::npos)
        bad.push_back(line);
  EXPECT_TRUE(bad.empty()) << listed(bad);
}

TEST(Layering, TheChecksFindWhatTheyLookFor) {  // the checks above can fail
  EXPECT_FALSE(environment_reads("launch").empty());
  EXPECT_FALSE(violations("actors", std::regex(R"("messages/type_ids.hpp")")).empty());
}
