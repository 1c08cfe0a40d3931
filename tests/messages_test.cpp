#include <gtest/gtest.h>

#include <caf/all.hpp>

#include "messages/type_ids.hpp"

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

TEST(Messages, TypeIdBlockRegistersEveryMessage) {
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
