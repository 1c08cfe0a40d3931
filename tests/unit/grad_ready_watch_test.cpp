// compute/optim/grad_buffer.hpp's grad_ready_watch: which gradient buckets are final during a
// backward (what lets the reduce-scatter of a bucket start before the backward ends).
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <vector>

#include "compute/models/model.hpp"
#include "compute/runtime/device.hpp"
#include "compute/optim/grad_buffer.hpp"
#include "compute/models/partition.hpp"

namespace troupe {

// The watch reports a bucket during the backward, and at that moment the bucket's
// gradients are already their final values (what the reduce-scatter then reads).
TEST(GradReadyWatch, ReportsEachBucketDuringTheLastBackwardWithItsFinalGradients) {
  const auto spec = model_spec::gpt_tiny();
  const auto init = initial_state(spec, 1);
  for (auto precision : {torch::kFloat32, torch::kBFloat16})
    for (auto mode : {recompute_mode::none, recompute_mode::full}) {
      auto slice = make_slice(spec, partition_layers(spec.n_layers(), 1)[0], init, 2, torch::kCPU, precision);
      slice->set_recompute(mode);
      const auto buckets = grad_buckets(slice->entries(), slice->flat_grads().numel(), 2, 20000);
      ASSERT_GT(buckets.size(), 4u);
      std::vector<int> order;
      std::map<int, torch::Tensor> at_report;
      grad_ready_watch watch(*slice, buckets, [&](int b) {
        order.push_back(b);
        at_report[b] = slice->flat_grads().narrow(0, buckets[b].begin, buckets[b].size()).clone();
      });
      // Each parameter's buckets: those its elements fall in.
      const auto& entries = slice->entries();
      std::size_t held = 0;
      for (std::size_t i = 0; i < entries.size(); ++i) {
        std::vector<int> want;
        for (std::size_t b = 0; b < buckets.size(); ++b) {
          const auto first = std::max(buckets[b].begin, entries[i].offset);
          if (first < buckets[b].end && entry_at(entries, first) == int(i)) want.push_back(int(b));
        }
        EXPECT_EQ(watch.buckets_holding(i), want) << entries[i].name;
        held += want.size();
      }
      EXPECT_GE(held, entries.size());
      torch::manual_seed(1);
      auto backward = [&] {
        auto tokens = torch::randint(0, 256, {2, spec.decoder.seq_len}, torch::kLong);
        torch::Tensor loss;
        {
          precision_scope amp(torch::kCPU, precision);
          loss = slice->loss(slice->forward(tokens), torch::randint(0, 256, {2, spec.decoder.seq_len}, torch::kLong));
        }
        loss.backward();
      };
      backward();  // an earlier micro-batch: not armed, nothing reported
      EXPECT_TRUE(order.empty());
      watch.arm();
      backward();
      const auto during = order.size();
      watch.finish();
      ASSERT_EQ(during, buckets.size()) << "every bucket is reported before the backward returns";
      EXPECT_EQ(watch.reported_early(), std::int64_t(buckets.size()));
      std::set<int> once(order.begin(), order.end());
      EXPECT_EQ(once.size(), buckets.size());
      // Reverse order, roughly: the last bucket (the last block and ln_f) first, the
      // first one (wte, tied to the output layer) last.
      EXPECT_EQ(order.front(), int(buckets.size()) - 1);
      EXPECT_EQ(order.back(), 0);
      for (auto& [b, g] : at_report)
        EXPECT_TRUE(g.equal(slice->flat_grads().narrow(0, buckets[b].begin, buckets[b].size())))
            << "bucket " << b << " changed after it was reported";
      // Unarmed, finish reports every bucket (a split backward's W, a tied chunk).
      order.clear();
      watch.finish();
      EXPECT_EQ(order.size(), buckets.size());
      // Disarmed (an aborted step): nothing.
      order.clear();
      watch.arm();
      watch.disarm();
      backward();
      EXPECT_TRUE(order.empty());
    }
}

}  // namespace troupe
