// `troupe generate` (compute/trainer/generate.cpp): greedy generation equals plain PyTorch's on
// the same weights, past the model's context too; sampling is seeded and keeps to the
// top k; bad input is refused.
#include <gtest/gtest.h>

#include <fstream>
#include <set>

#include "compute/checkpoint/checkpoint.hpp"
#include "compute/trainer/generate.hpp"
#include "compute/models/partition.hpp"
#include "compute/trainer/local_trainer.hpp"
#include "cached_forward.hpp"
#include "test_util.hpp"
#include "build_paths.hpp"

namespace troupe {

namespace {

// A small gpt (context 24 bytes) trained for 150 steps: its next-byte distributions are
// far from uniform, so the most likely byte is not a near tie.
job_config small_gpt() {
  auto c = test::gpt_config(150);
  c.layers = 2;
  c.heads = 2;
  c.d_model = 32;
  c.seq_len = 24;
  c.lr = 3e-3;
  c.min_lr = 3e-4;
  c.eval_interval = 0;
  c.validate();
  return c;
}

const state_dict& trained() {
  static const state_dict state = [] {
    local_trainer t(small_gpt());
    while (t.next_step() < t.config().steps) t.step();
    return t.state();
  }();
  return state;
}

/// The model's logits for the byte after `ids` (its last seq_len bytes).
torch::Tensor next_logits(const model_slice& m, const std::vector<std::int64_t>& ids, std::size_t end, int seq_len) {
  const std::size_t from = end > std::size_t(seq_len) ? end - seq_len : 0;
  auto& model = const_cast<model_slice&>(m);
  const auto x = torch::tensor(std::vector<std::int64_t>(ids.begin() + from, ids.begin() + end)).view({1, -1});
  return model.logits(model.forward(x))[0][-1];
}

std::vector<std::int64_t> bytes_of(const std::string& s) {
  std::vector<std::int64_t> out;
  for (unsigned char c : s) out.push_back(c);
  return out;
}

}  // namespace

TEST(Generate, GreedyEqualsPlainPytorchPastTheContext) {
  test::temp_dir dir;
  const auto c = small_gpt();
  save_state_dict(dir / "model.pt", trained());
  sampling_options s;
  s.temperature = 0;
  s.tokens = 40;  // prompt 5 + 40 bytes: past the 24-byte context
  std::string streamed;
  const auto text = generate(c.model(), trained(), "The q", s, torch::kCPU, [&](char ch) { streamed += ch; });
  ASSERT_EQ(text.size(), 45u);
  EXPECT_EQ(text.substr(0, 5), "The q");
  EXPECT_EQ(streamed, text.substr(5));

  const std::string cmd = std::string("/usr/bin/python3 ") + troupe::test::source_dir + "/tests/support/python/gpt_generate.py " +
                          (dir / "model.pt") + " 'The q' 40 --layers 2 --heads 2 --d-model 32 --seq-len 24 > " +
                          (dir / "ids.txt");
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::ifstream in(dir / "ids.txt");
  std::vector<std::int64_t> expected;
  for (std::int64_t x; in >> x;) expected.push_back(x);
  EXPECT_EQ(bytes_of(text), expected);
  std::set<char> distinct(text.begin() + 5, text.end());
  EXPECT_GT(distinct.size(), 1u) << "a trained model's greedy text is not one repeated byte: " << text;
}

TEST(Generate, SamplingIsSeededAndKeepsToTheTopK) {
  const auto spec = small_gpt().model();
  sampling_options s;
  s.tokens = 60;
  s.temperature = 1.0;
  s.seed = 5;
  const auto a = generate(spec, trained(), "A", s);
  EXPECT_EQ(generate(spec, trained(), "A", s), a);  // same seed, same text
  s.seed = 6;
  EXPECT_NE(generate(spec, trained(), "A", s), a);
  // top-k 1 is greedy, whatever the temperature.
  s.top_k = 1;
  auto greedy = s;
  greedy.temperature = 0;
  greedy.top_k = 0;
  EXPECT_EQ(generate(spec, trained(), "A", s), generate(spec, trained(), "A", greedy));
  // top-k 3: every byte is one of the 3 most likely given the bytes before it.
  s.top_k = 3;
  s.temperature = 2.0;  // flattened: without the cut, unlikely bytes would come
  const auto text = generate(spec, trained(), "A", s);
  layer_range whole;
  whole.last = spec.n_layers();
  const auto model = make_slice(spec, whole, trained());
  torch::NoGradGuard no_grad;
  const auto ids = bytes_of(text);
  for (std::size_t i = 1; i < ids.size(); ++i) {
    const auto top = std::get<1>(next_logits(*model, ids, i, spec.decoder.seq_len).topk(3));
    EXPECT_TRUE((top == ids[i]).any().item<bool>()) << "byte " << i << " (" << ids[i] << ") is not in the top 3";
  }
}

TEST(Generate, BadInputIsRefused) {
  const auto spec = small_gpt().model();
  sampling_options s;
  EXPECT_THROW(generate(spec, trained(), "", s), std::invalid_argument);
  s.temperature = -1;
  EXPECT_THROW(generate(spec, trained(), "A", s), std::invalid_argument);
  s = {};
  s.top_k = -2;
  EXPECT_THROW(generate(spec, trained(), "A", s), std::invalid_argument);
  s = {};
  EXPECT_THROW(generate(model_spec::fmnist_mlp(), trained(), "A", s), model_error);
  try {
    generate(model_spec::gpt_tiny(), trained(), "A", s);
    ADD_FAILURE() << "the small model's weights were taken for gpt-tiny";
  } catch (const model_error& e) {
    EXPECT_NE(std::string(e.what()).find("wte.weight has shape [256, 32], expected [256, 128]"), std::string::npos)
        << e.what();
  }
}

TEST(Generate, CachedForwardEqualsTheFullForward) {
  const auto spec = small_gpt().model();  // 2 layers, context 24
  auto run = test::expect_cached_forward_equals_full(spec, trained());
  auto& model = run.model;
  auto& first = run.first;
  auto& second = run.second;
  auto& cache = run.cache;
  const auto& ids = run.ids;
  const auto& full = run.full;
  torch::NoGradGuard no_grad;

  // Past the context: refused, and the cache is left as it was.
  try {
    model->forward_cached(ids.slice(1, 0, 1), cache);
    ADD_FAILURE() << "a position past the context was taken";
  } catch (const model_error& e) {
    EXPECT_NE(std::string(e.what()).find("past the model's context of 24"), std::string::npos) << e.what();
  }
  EXPECT_EQ(cache.length, spec.decoder.seq_len);
  // A cache filled by a slice of 2 blocks does not fit a slice of 1.
  kv_cache two_blocks;
  model->forward_cached(ids.slice(1, 0, 3), two_blocks);
  try {
    second->forward_cached(first->forward(ids.slice(1, 0, 1)), two_blocks);
    ADD_FAILURE() << "a cache of 2 blocks was taken by a slice of 1";
  } catch (const model_error& e) {
    EXPECT_NE(std::string(e.what()).find("holds 2 blocks' keys; this slice has 1 blocks"), std::string::npos)
        << e.what();
  }
  // Another number of sequences than the cache holds is refused; a cache that starts
  // again takes it (and keeps its buffers where they fit).
  kv_cache two_sequences;
  model->forward_cached(ids.slice(1, 0, 2), two_sequences);
  try {
    model->forward_cached(ids.slice(0, 0, 1).slice(1, 2, 3), two_sequences);
    ADD_FAILURE() << "one sequence was taken by a cache of two";
  } catch (const model_error& e) {
    EXPECT_NE(std::string(e.what()).find("holds 2 sequences; the input has 1"), std::string::npos) << e.what();
  }
  EXPECT_EQ(two_sequences.length, 2);
  const void* kept = two_sequences.keys[0].data_ptr();
  two_sequences.length = 0;
  const auto again = model->forward_cached(ids.slice(1, 0, 4), two_sequences);
  EXPECT_EQ(two_sequences.keys[0].data_ptr(), kept);
  EXPECT_TRUE(torch::allclose(again, full.slice(1, 0, 4), 1e-5, 1e-5));
  two_sequences.length = 0;
  const auto one = model->forward_cached(ids.slice(0, 1, 2).slice(1, 0, 4), two_sequences);
  EXPECT_EQ(two_sequences.keys[0].size(0), 1);
  EXPECT_TRUE(torch::allclose(one, full.slice(0, 1, 2).slice(1, 0, 4), 1e-5, 1e-5));
  // The MLP has no attention to cache.
  layer_range mlp_whole;
  mlp_whole.last = model_spec::fmnist_mlp().n_layers();
  const auto mlp = make_slice(model_spec::fmnist_mlp(), mlp_whole, initial_state(model_spec::fmnist_mlp(), 1));
  kv_cache unused;
  EXPECT_THROW(mlp->forward_cached(torch::zeros({1, 784}), unused), model_error);
}

TEST(Generate, TheCacheChangesNoGreedyByte) {
  const auto spec = small_gpt().model();
  sampling_options s;
  s.temperature = 0;
  s.tokens = 60;  // within the context, then past it
  const auto cached = generate(spec, trained(), "In the", s);
  s.kv_cache = false;
  EXPECT_EQ(generate(spec, trained(), "In the", s), cached);
  // A prompt longer than the context starts past it.
  const std::string long_prompt(30, 'a');
  s.tokens = 5;
  const auto uncached = generate(spec, trained(), long_prompt, s);
  s.kv_cache = true;
  EXPECT_EQ(generate(spec, trained(), long_prompt, s), uncached);
}

}  // namespace troupe
