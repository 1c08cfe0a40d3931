// The board from which a node reports the actors whose threads are inside an op
// (actors/activity_board.hpp), for the wait-for graph of a hang.
#include <gtest/gtest.h>

#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "actors/activity_board.hpp"
#include "actors/wait_graph.hpp"

namespace troupe {

TEST(ActivityBoard, ReportsTheOpAndTheCollectiveOfEachThreadOfTheStep) {
  auto group = std::make_shared<const group_identity>(group_identity{"test group", {"a", "b"}});
  const std::string a = "a", b = "b";
  auto find = [](const std::vector<wait_report>& rs, const std::string& actor) -> const wait_report* {
    for (const auto& r : rs)
      if (r.actor == actor) return &r;
    return nullptr;
  };
  {
    activity_board::op_scope busy(a, 3, /*generation=*/1, /*step=*/4, "F", 2, 0);
    std::promise<void> entered, release;
    std::thread other([&] {
      activity_board::op_scope in_b(b, 3, 1, 4, "B", 5, 1);
      activity_board::enter_collective("all-gather", group, 6);
      entered.set_value();
      release.get_future().wait();
      activity_board::leave_collective();
    });
    entered.get_future().wait();
    auto rs = activity_board::reports(1, 4);
    const auto* ra = find(rs, "a");
    const auto* rb = find(rs, "b");
    ASSERT_TRUE(ra && rb);
    EXPECT_TRUE(ra->waits_for.empty());
    EXPECT_EQ(ra->node, 3);
    EXPECT_EQ(ra->state.rfind("its thread is in op F2 (mb 2, chunk 0) for ", 0), 0u) << ra->state;
    EXPECT_EQ(rb->waits_for, "all-gather #7 of the test group");
    EXPECT_EQ(rb->collective, "test group #7");
    EXPECT_EQ(rb->from, std::vector<std::string>{"a"});
    EXPECT_NE(rb->state.find("its thread is in op B5 (mb 5, chunk 1) for "), std::string::npos) << rb->state;
    EXPECT_NE(rb->state.find(", in the all-gather for "), std::string::npos) << rb->state;
    EXPECT_TRUE(activity_board::reports(0, 4).empty()) << "another generation's";
    EXPECT_TRUE(activity_board::reports(1, 3).empty()) << "another step's";
    // A nested scope (a sum after the op) and back.
    {
      activity_board::op_scope sum(a, 3, 1, 4, "the sum of the replicated parameters' gradients", -1, 0);
      rs = activity_board::reports(1, 4);
      EXPECT_EQ(find(rs, "a")->state.rfind("its thread is in the sum of the replicated parameters' gradients (chunk 0)", 0),
                0u);
    }
    rs = activity_board::reports(1, 4);
    EXPECT_EQ(find(rs, "a")->state.rfind("its thread is in op F2", 0), 0u);
    release.set_value();
    other.join();
    rs = activity_board::reports(1, 4);
    EXPECT_EQ(find(rs, "b"), nullptr) << "its scope ended with its thread";
  }
  EXPECT_TRUE(activity_board::reports(1, 4).empty());
  activity_board::enter_collective("all-reduce", group, 0);  // outside an op: nothing
  EXPECT_TRUE(activity_board::reports(0, -1).empty());
}

}  // namespace troupe
