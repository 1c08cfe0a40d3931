#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <string>
#include <utility>

#include <caf/all.hpp>

#include "actors/payload.hpp"
#include "messages/type_ids.hpp"
#include "build_paths.hpp"

namespace troupe {

TEST(Messages, PayloadChecksShapeDtypeAndChecksum) {
  auto t = torch::randn({4, 8});
  auto p = make_payload(t, /*with_checksum=*/true);
  EXPECT_EQ(check_payload(p, {4, 8}, torch::kFloat32), "");
  EXPECT_EQ(tensor_of(p).data_ptr(), t.data_ptr()) << "in-process hand-off must not copy";
  EXPECT_NE(check_payload(p, {4, 9}, torch::kFloat32).find("shape [4, 8], expected [4, 9]"), std::string::npos);
  EXPECT_NE(check_payload(p, {4, 8}, torch::kInt64).find("dtype"), std::string::npos);
  t[1][2] = 42.0f;  // corrupt the bytes after the checksum was taken
  EXPECT_NE(check_payload(p, {4, 8}, torch::kFloat32).find("checksum"), std::string::npos);
  EXPECT_NE(check_payload(tensor_payload{}, {1}, torch::kFloat32), "");
}

namespace {
// The names of every type in the troupe type-ID block.
template <std::size_t... I>
std::set<std::string> registered_names(std::index_sequence<I...>) {
  return {caf::type_name_by_id<caf::id_block::troupe::begin + I>::value...};
}

// The top-level structs a header declares.
std::vector<std::string> declared_structs(const std::filesystem::path& header) {
  std::ifstream in(header);
  EXPECT_TRUE(in.good()) << header;
  std::vector<std::string> names;
  static const std::regex decl(R"(^struct (\w+) \{)");
  std::smatch m;
  for (std::string line; std::getline(in, line);)
    if (std::regex_search(line, m, decl)) names.push_back(m[1]);
  return names;
}
}  // namespace

TEST(Messages, TypeIdBlockRegistersEveryMessage) {
  const auto names = registered_names(
      std::make_index_sequence<caf::id_block::troupe::end - caf::id_block::troupe::begin>{});
  std::size_t declared = 0;
  // Every struct of every messages/ header is a message (a helper type belongs elsewhere).
  for (const auto& entry : std::filesystem::directory_iterator(std::string(troupe::test::source_dir) + "/messages")) {
    if (entry.path().extension() != ".hpp" || entry.path().filename() == "type_ids.hpp") continue;
    for (const auto& name : declared_structs(entry.path())) {
      ++declared;
      EXPECT_EQ(names.count("troupe::" + name), 1u)
          << name << " (" << entry.path().filename() << ") has no CAF_ADD_TYPE_ID in messages/type_ids.hpp";
    }
  }
  EXPECT_GT(declared, 30u) << "the headers' structs were not found";

  caf::actor_system_config cfg;
  cfg.add_message_types<caf::id_block::troupe>();
  caf::actor_system sys{cfg};
  EXPECT_EQ(caf::type_name<troupe::forward_activation>::value, std::string("troupe::forward_activation"));
  EXPECT_GT(caf::id_block::troupe::end - caf::id_block::troupe::begin, 20);
  // Messages print through their inspect(): metadata, never tensor bytes.
  const auto text = caf::deep_to_string(forward_activation{3, 1, 0, make_payload(torch::zeros({2, 2}))});
  EXPECT_NE(text.find("3"), std::string::npos) << text;
}

}  // namespace troupe
