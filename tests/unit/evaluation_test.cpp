// Evaluation of long validation windows, a few at a time.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <fstream>
#include <thread>

#include "compute/checkpoint/checkpoint.hpp"
#include "compute/trainer/local_trainer.hpp"
#include "held_bytes.hpp"
#include "test_util.hpp"

namespace troupe {

// Evaluation takes long validation windows a few at a time (eval_tokens_per_forward): the
// loss is that of all of them in one forward up to float rounding, and the memory the
// evaluation takes at its peak is a fraction (here 32 windows of 1024 tokens, as
// gpt-small's: their attention scores alone were 268 MB per block at once).
TEST(Evaluation, LongWindowsGoThroughTheModelAFewAtATime) {
  const int threads = torch::get_num_threads();  // given back: later tests of this process compare at theirs
  torch::set_num_threads(1);
  struct restore_threads {
    int n;
    ~restore_threads() { torch::set_num_threads(n); }
  } restore{threads};
  model_spec spec;
  spec.decoder = {2, 2, 32, 64, 1024, 256};  // gpt-small's window length on a small model
  local_pipeline model(spec, initial_state(spec, 3), 1);
  std::vector<std::uint8_t> text(text_corpus::min_bytes(1024) + 5000);
  for (std::size_t i = 0; i < text.size(); ++i) text[i] = std::uint8_t(" etaoinshrdlu\n"[(i * 7919 + i / 13) % 14]);
  const auto set = text_corpus(text).validation_batch(1024);
  ASSERT_EQ(set.input.size(0), 32);
  // Peak of malloc's bytes in use above the start while evaluate_model runs (sampled).
  auto evaluate = [&](std::int64_t tokens_per_forward, std::int64_t& peak) {
    const auto before = test::malloc_bytes_in_use();
    std::atomic<bool> done{false};
    std::atomic<std::int64_t> high{0};
    std::thread sampler([&] {
      while (!done) {
        high = std::max<std::int64_t>(high, test::malloc_bytes_in_use() - before);
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    });
    const double loss = evaluate_model(model, set, true, 0, tokens_per_forward).loss;
    done = true;
    sampler.join();
    peak = high;
    return loss;
  };
  std::int64_t whole_peak = 0, default_peak = 0, one_peak = 0;
  const double whole = evaluate(32 * 1024, whole_peak);
  const double by_eight = evaluate(eval_tokens_per_forward, default_peak);  // 8 windows a forward
  const double by_one = evaluate(1, one_peak);                              // 1 window a forward
  std::printf("evaluation peaks: 32 windows a forward %.1f MB, 8: %.1f MB, 1: %.1f MB; losses %.9f %.9f %.9f\n",
              whole_peak / 1e6, default_peak / 1e6, one_peak / 1e6, whole, by_eight, by_one);
  EXPECT_NEAR(by_eight, whole, 1e-6 * whole);
  EXPECT_NEAR(by_one, whole, 1e-6 * whole);
  EXPECT_LT(default_peak, whole_peak / 2) << "peaks: " << default_peak << " (8 windows) vs " << whole_peak << " (32)";
  EXPECT_LT(one_peak, default_peak) << "peaks: " << one_peak << " (1 window) vs " << default_peak << " (8)";
  // gpt-tiny's validation windows stay one forward, as before.
  EXPECT_GE(eval_tokens_per_forward / model_spec::gpt_tiny().decoder.seq_len, 32);
}

}  // namespace troupe

namespace troupe {

// A Megatron dataset's ids without a tokenizer: their bytes are not known, so no bits per
// byte is reported (not bits per token under that name).
TEST(Evaluation, IdsWithoutATokenizerReportNoBitsPerByte) {
  evaluation e;
  e.loss = 2.0;
  e.bytes_per_target = 0;
  EXPECT_EQ(e.fields(), (std::vector<std::pair<std::string, double>>{{"val_loss", 2.0}}));
  EXPECT_NE(e.summary().find("bits per byte unknown"), std::string::npos) << e.summary();
  e.bytes_per_target = 2.0;
  EXPECT_NEAR(e.bits_per_byte(), 2.0 / std::log(2.0) / 2.0, 1e-12);
  EXPECT_EQ(e.fields().size(), 2u);
}

}  // namespace troupe
