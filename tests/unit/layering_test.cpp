// The layers of docs/architecture.md, checked on the sources: compute/ never includes CAF
// (nor the layers above it), transport/ knows neither models nor actors, messages/
// depends only on CAF and LibTorch. Inside compute/, the wings keep their order, and no
// two modules (a header and its source file) include each other, directly or through a
// cycle.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <fstream>
#include <map>
#include <regex>
#include <set>
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

/// The modules of a layer ("compute/models/model" for model.hpp and model.cpp) and the
/// project's modules each includes (itself left out).
using include_graph = std::map<std::string, std::set<std::string>>;
include_graph modules_of(const std::string& layer) {
  include_graph graph;
  const std::filesystem::path root = std::string(troupe::test::source_dir) + "/" + layer;
  const std::regex include(R"re(^#include "((compute|actors|transport|messages|launch)/[^"]+)\.(hpp|h)")re");
  for (const auto& entry : std::filesystem::recursive_directory_iterator(root)) {
    const auto ext = entry.path().extension();
    if (ext != ".hpp" && ext != ".cpp") continue;
    auto module = entry.path().lexically_relative(troupe::test::source_dir).replace_extension().string();
    auto& edges = graph[module];
    std::ifstream in(entry.path());
    std::smatch m;
    for (std::string line; std::getline(in, line);)
      if (std::regex_search(line, m, include) && m[1] != module) edges.insert(m[1]);
  }
  return graph;
}

/// A cycle of `graph` ("a -> b -> a"), or "" when it has none (depth-first search).
std::string cycle_of(const include_graph& graph) {
  std::map<std::string, int> state;  // 1: on the path, 2: done
  std::vector<std::string> path;
  std::string found;
  std::function<bool(const std::string&)> visit = [&](const std::string& v) {
    state[v] = 1;
    path.push_back(v);
    const auto it = graph.find(v);
    if (it != graph.end())
      for (const auto& w : it->second) {
        if (!graph.count(w)) continue;  // another layer's
        if (state[w] == 1) {
          auto at = std::find(path.begin(), path.end(), w);
          for (; at != path.end(); ++at) found += *at + " -> ";
          found += w;
          return true;
        }
        if (state[w] == 0 && visit(w)) return true;
      }
    path.pop_back();
    state[v] = 2;
    return false;
  };
  for (const auto& [v, edges] : graph)
    if (state[v] == 0 && visit(v)) return found;
  return "";
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

// compute/'s wings (docs/architecture.md): runtime/ under all of them; parallel/ (the
// collectives of tensor and expert parallelism) knows no model; checkpoint/ (files and
// folders) knows no training loop; data/ reads its files without checkpoint/.
TEST(Layering, ComputesWingsKeepTheirOrder) {
  const std::vector<std::pair<std::string, std::string>> rules{
      {"compute/runtime", R"("compute/(parallel|models|optim|schedule|data|checkpoint|config|trainer)/)"},
      {"compute/parallel", R"("compute/models/)"},
      {"compute/checkpoint", R"("compute/trainer/)"},
      {"compute/data", R"("compute/checkpoint/)"},
  };
  for (const auto& [wing, forbidden] : rules) {
    const auto bad = violations(wing, std::regex(forbidden));
    EXPECT_TRUE(bad.empty()) << wing << ":" << listed(bad);
  }
}

TEST(Layering, NoTwoModulesIncludeEachOther) {
  for (const char* layer : {"compute", "transport", "messages"}) {
    const auto cycle = cycle_of(modules_of(layer));
    EXPECT_EQ(cycle, "") << layer << " has modules that include each other: " << cycle;
  }
}

TEST(Layering, TheChecksFindWhatTheyLookFor) {  // the checks above can fail
  EXPECT_FALSE(environment_reads("launch").empty());
  EXPECT_FALSE(violations("actors", std::regex(R"("messages/type_ids.hpp")")).empty());
  EXPECT_FALSE(violations("compute/trainer", std::regex(R"("compute/checkpoint/)")).empty());
  EXPECT_EQ(cycle_of({{"a", {"b"}}, {"b", {"c"}}, {"c", {"a"}}, {"d", {"a"}}}), "a -> b -> c -> a");
  EXPECT_EQ(cycle_of({{"a", {"b"}}, {"b", {"c"}}, {"c", {}}, {"d", {"a", "x"}}}), "");
  EXPECT_GT(modules_of("compute").size(), 40u);
}
