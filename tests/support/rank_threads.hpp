#pragma once
// Ranks of an in-process communicator as threads, for the transport tests.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <thread>
#include <vector>

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

}  // namespace troupe::test
