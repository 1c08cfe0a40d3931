#pragma once
// Ranks of an in-process communicator (or of a collective group) as threads, for the
// transport and parallel layers' tests.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "actors/tp_groups.hpp"

namespace troupe::test {

/// One random input of `size` elements per rank.
inline std::vector<torch::Tensor> inputs(int n, std::int64_t size) {
  std::vector<torch::Tensor> all;
  for (int r = 0; r < n; ++r) all.push_back(torch::randn({size}));
  return all;
}

/// Runs f(rank) on one thread per rank.
template <class F>
void on_threads(int n, F f) {
  std::vector<std::thread> ts;
  std::vector<std::string> errors(n);
  for (int r = 0; r < n; ++r)
    ts.emplace_back([&, r] {
      try {
        f(r);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : ts) t.join();
  for (int r = 0; r < n; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

/// Runs fn(rank, group) on `size` threads, one per rank of an in-process collective
/// group; a rank that throws fails the group's collectives (its peers would wait for it).
inline void on_group_ranks(int size, const std::function<void(int, std::shared_ptr<collective_group>)>& fn) {
  auto groups = in_process_groups(size);
  std::vector<std::thread> threads;
  std::vector<std::string> errors(static_cast<std::size_t>(size));
  for (int t = 0; t < size; ++t)
    threads.emplace_back([&, t] {
      try {
        fn(t, groups[std::size_t(t)]);
      } catch (const std::exception& e) {
        errors[std::size_t(t)] = e.what();
        for (auto& g : groups) g->abort(e.what());
      }
    });
  for (auto& th : threads) th.join();
  for (const auto& e : errors) ASSERT_EQ(e, "");
}

}  // namespace troupe::test
