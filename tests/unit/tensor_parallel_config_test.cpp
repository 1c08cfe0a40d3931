// Tensor-parallel layouts that cannot work are refused with what fits.
#include <gtest/gtest.h>

#include <thread>

#include <torch/nn/functional.h>

#include "actors/tp_groups.hpp"
#include "ucx_groups.hpp"
#include "compute/parallel/tensor_parallel.hpp"
#include "compute/models/tensor_parallel_layout.hpp"
#include "compute/trainer/local_trainer.hpp"
#include "test_util.hpp"
#include "tp_test_util.hpp"


namespace troupe {

using namespace tp_test;

TEST(TensorParallelConfig, LayoutsThatCannotWorkSayWhichNumberAndWhatFits) {
  const auto error_of = test::config_error_of;
  auto c = small_job();
  c.tensor_parallel = 3;
  EXPECT_NE(error_of(c).find("tensor_parallel = 3 does not divide model.heads = 4"), std::string::npos) << error_of(c);
  EXPECT_NE(error_of(c).find("fit this model: 1, 2, 4"), std::string::npos) << error_of(c);
  // Key/value heads: T a multiple of them replicates them (4 ranks over 2 heads); 2 ranks
  // over 3 heads cannot share them.
  auto llama = small_job("llama-tiny");
  llama.tensor_parallel = 4;
  EXPECT_EQ(error_of(llama), "");
  llama.heads = 6;
  llama.kv_heads = 3;
  llama.d_model = 48;
  llama.d_ff = 96;
  llama.tensor_parallel = 2;
  EXPECT_NE(error_of(llama).find("tensor_parallel = 2 and model.kv_heads = 3: neither divides the other"),
            std::string::npos)
      << error_of(llama);
  EXPECT_NE(error_of(llama).find("fit this model: 1"), std::string::npos) << error_of(llama);
  c.tensor_parallel = 2;
  c.d_ff = 33;
  EXPECT_NE(error_of(c).find("does not divide model.d_ff = 33"), std::string::npos) << error_of(c);
  c.d_ff = 0;
  c.seq_len = 33;
  EXPECT_EQ(error_of(c), "");  // without sequence parallelism the sequence stays whole
  c.sequence_parallel = true;
  EXPECT_NE(error_of(c).find("model.seq_len (with parallel.sequence_parallel) = 33"), std::string::npos)
      << error_of(c);
  auto mlp = job_config::defaults_for("fmnist-mlp");
  mlp.runtime = "local";
  mlp.tensor_parallel = 2;
  EXPECT_NE(error_of(mlp).find("fmnist-mlp has none"), std::string::npos) << error_of(mlp);
  // (The actor runtime's refusals: tensor_parallel_actors_test.cpp.)
  // A loop given no groups says so.
  auto two = small_job();
  two.tensor_parallel = 2;
  EXPECT_THROW(local_trainer t(two), config_error);
}

}  // namespace troupe
