// The planner (compute/plan/planner.hpp): its step model against the schedule simulator,
// its memory model, its refusals, the search, and published large-scale results.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>
#include <thread>

#include "actors/tp_groups.hpp"
#include "compute/plan/planner.hpp"
#include "compute/schedule/timed_simulation.hpp"
#include "tests/support/build_paths.hpp"
#include "tests/support/temp_dir.hpp"

namespace troupe::plan {
namespace {

problem llama8b(int devices) {
  problem p;
  auto& m = p.model;
  m.n_layer = 32, m.d_model = 4096, m.n_head = 32, m.n_kv_head = 8, m.d_ff = 14336, m.vocab = 128256;
  m.arch = decoder_arch::llama, m.tie_embeddings = false;
  p.seq_len = 4096, p.global_batch = 256, p.devices = devices;
  p.device = builtin_device("h100");
  return p;
}

layout make(int tp, int pp, int dp, int mb, const problem& p, schedule_kind k = schedule_kind::one_f_one_b, int vp = 1) {
  layout l;
  l.tp = tp, l.pp = pp, l.dp = dp, l.vp = vp, l.micro_batch = mb, l.schedule = k;
  l.microbatches = p.global_batch / (dp * mb);
  return l;
}

TEST(Plan, PipelineIsTheScheduleSimulatedWithTheLayersCosts) {
  // Four stages of 8 layers each and no communication (one node, dp 1): the pipeline's
  // makespan is the plain simulator's with one stage's forward and backward, and the
  // bubble 1f1b's (p - 1) / (m + p - 1) up to the first and last stages' extra work.
  auto p = llama8b(4);
  p.model.vocab = 256;  // (the embedding and output layer negligible)
  p.global_batch = 8;
  const auto pred = predict(p, make(1, 4, 1, 1, p));
  const auto s = make_schedule(schedule_kind::one_f_one_b, 4, 8);
  EXPECT_NEAR(pred.bubble, 3.0 / 11, 0.01);
  const double per_mb = pred.parts.compute / 8;  // the busiest stage's F + B per micro-batch
  EXPECT_NEAR(pred.parts.pipeline, per_mb * 11, per_mb * 11 * 0.02);
  EXPECT_GT(pred.step_seconds, pred.parts.pipeline);  // the optimizer step after it
  EXPECT_LT(pred.step_seconds, pred.parts.pipeline * 1.05);
  (void)s;
}

TEST(Plan, TransferTimesDelayDependentOps) {
  const auto s = make_schedule(schedule_kind::one_f_one_b, 2, 1);
  timed_costs c;
  c.op = [](int, const pipeline_op& op) { return op.kind == op_kind::forward ? 1.0 : 2.0; };
  EXPECT_DOUBLE_EQ(simulate(s, c).makespan, 6.0);  // F F B B
  c.transfer = [](int from, int to) { return from < to ? 0.5 : 0.25; };
  EXPECT_DOUBLE_EQ(simulate(s, c).makespan, 6.75);
}

TEST(Plan, MemoryNamesEveryBuffer) {
  auto p = llama8b(8);
  const auto a = predict(p, make(1, 1, 8, 1, p));
  const double n = parameter_count(p.model);
  EXPECT_NEAR(a.memory.params, 2 * n, 1e-6 * n);      // bf16, whole
  EXPECT_NEAR(a.memory.grads, 4 * n, 1e-6 * n);       // fp32, whole
  EXPECT_NEAR(a.memory.optimizer, 12 * n / 8, 1e-6 * n);  // main copy and moments, 1/dp
  EXPECT_FALSE(a.fits);  // 8B at dp 8 without sharding: about 60 GB before activations
  // Parameters sharded (FSDP by blocks): 1/dp of them and of the gradients, plus the
  // working set: the embedding and the output layer (the chunk's rest, all of one
  // stage's), two blocks' parameters (one computing, the next prefetched), one block's
  // gradients.
  auto sharded = make(1, 1, 8, 1, p);
  sharded.shard = "parameters";
  const auto z3 = predict(p, sharded);
  const double rest = 2.0 * p.model.vocab * p.model.d_model, block = (n - rest) / p.model.n_layer;
  EXPECT_NEAR(z3.memory.params, 2 * (n / 8 + rest + 2 * block), 1e-3 * n);
  EXPECT_NEAR(z3.memory.grads, 4 * (n / 8 + rest + block), 1e-3 * n);
  // Tensor parallelism divides parameters and activations; full recompute keeps one
  // input per layer (and one layer's whole activations while it recomputes).
  p.model.vocab = 256;  // (no logits: they are kept either way)
  auto l = make(8, 1, 1, 1, p);
  const auto t8 = predict(p, l);
  EXPECT_LT(t8.memory.params, a.memory.params / 7);
  l.recompute = true;
  const auto rc = predict(p, l);
  EXPECT_LT(rc.memory.activations, t8.memory.activations / 5);
  EXPECT_GT(rc.step_seconds, t8.step_seconds * 1.2);  // a forward more in every backward
}

TEST(Plan, RefusesLayoutsThatCannotRun) {
  auto p = llama8b(16);
  EXPECT_NE(check_layout(p, make(3, 1, 5, 1, p)).find("not the 16 devices"), std::string::npos);
  auto bad_heads = p;
  bad_heads.devices = 12;
  bad_heads.global_batch = 240;
  EXPECT_NE(check_layout(bad_heads, make(12, 1, 1, 1, bad_heads)).find("does not divide"), std::string::npos);
  auto l = make(1, 1, 16, 1, p);
  l.microbatches = 3;
  EXPECT_NE(check_layout(p, l).find("global batch"), std::string::npos);
  EXPECT_NE(check_layout(p, make(1, 4, 4, 1, p, schedule_kind::zbv, 1)).find("schedule"), std::string::npos);
  EXPECT_NE(check_layout(p, make(1, 4, 4, 1, p, schedule_kind::one_f_one_b, 2)).find("chunks"), std::string::npos);
  l = make(8, 1, 2, 1, p);
  l.shard = "everything";
  EXPECT_NE(check_layout(p, l).find("shard must be"), std::string::npos);
  l.shard = "parameters";  // (Troupe's FSDP composes with tensor parallelism and experts)
  EXPECT_EQ(check_layout(p, l), "");
  EXPECT_THROW(predict(p, make(3, 1, 5, 1, p)), plan_error);
  EXPECT_THROW(builtin_device("tpu"), plan_error);
}

TEST(Plan, SearchRanksLayoutsThatFit) {
  auto p = llama8b(64);
  const auto result = search(p, {}, 20);
  const auto& found = result.best;
  ASSERT_EQ(found.size(), 20u);
  EXPECT_GT(result.considered, result.fitting);
  EXPECT_GE(result.fitting, found.size());
  for (std::size_t i = 0; i < found.size(); ++i) {
    EXPECT_TRUE(found[i].fits);
    EXPECT_EQ(found[i].l.devices(), 64);
    EXPECT_EQ(check_layout(p, found[i].l), "");
    EXPECT_LE(found[i].memory.total(), p.device.memory_bytes);
    if (i) {
      EXPECT_LE(found[i - 1].step_seconds, found[i].step_seconds);
    }
  }
  // Tensor parallelism stays within a node of 8.
  for (const auto& f : found) EXPECT_LE(f.l.tp, 8);
  search_limits only;
  only.pp = 2, only.tp = 4;
  const auto limited = search(p, only, 0);
  EXPECT_FALSE(limited.best.empty());
  EXPECT_EQ(limited.best.size(), limited.fitting);
  for (const auto& f : limited.best) EXPECT_TRUE(f.l.pp == 2 && f.l.tp == 4);
}

// Hybrid sharding (layout::shard_group): the state over a node's 8 ranks instead of all
// 64, and the gradients' reduce-scatter within the node, then an all-reduce of 1/8 of them
// across the nodes: more memory, less traffic over the slower link between nodes.
TEST(Plan, HybridShardingTradesMemoryForTrafficBetweenNodes) {
  auto p = llama8b(64);
  auto whole = make(1, 1, 64, 1, p);
  whole.shard = "parameters";
  auto hybrid = whole;
  hybrid.shard_group = 8;
  EXPECT_EQ(hybrid.shard_label(), "parameters/g8");
  EXPECT_EQ(whole.shard_label(), "parameters");
  const auto w = predict(p, whole), h = predict(p, hybrid);
  const double n = parameter_count(p.model);
  EXPECT_NEAR(w.memory.optimizer, 12 * n / 64, 1e-6 * n);
  EXPECT_NEAR(h.memory.optimizer, 12 * n / 8, 1e-6 * n);
  EXPECT_NEAR(h.memory.grads - w.memory.grads, 4 * (n / 8 - n / 64), 1e-6 * n);
  // The collectives' share the step waits for: the same fraction of each, so their ratio
  // is that of the rings' times over the two links.
  const auto& d = p.device;
  const double whole_rings = d.inter.ring(4 * n, 64) + d.inter.ring(d.dtype_bytes * n, 64);
  const double hybrid_rings = d.intra.ring(4 * n, 8) + d.inter.ring(4 * n / 8, 8, 2) + d.intra.ring(d.dtype_bytes * n, 8);
  EXPECT_NEAR(h.parts.dp_exposed / w.parts.dp_exposed, hybrid_rings / whole_rings, 1e-6);
  EXPECT_LT(h.parts.dp_exposed, w.parts.dp_exposed / 2);
  auto bad = whole;
  bad.shard_group = 3;
  EXPECT_NE(check_layout(p, bad).find("must divide"), std::string::npos);
  // The search tries both; --shard-group limits it.
  search_limits only;
  only.tp = 1, only.pp = 1, only.shard = "parameters";
  bool saw_whole = false, saw_hybrid = false;
  for (const auto& f : search(p, only, 0).best) (f.l.hybrid() ? saw_hybrid : saw_whole) = true;
  EXPECT_TRUE(saw_whole && saw_hybrid);
  only.shard_group = 8;
  const auto hybrid_only = search(p, only, 0);
  EXPECT_FALSE(hybrid_only.best.empty());
  for (const auto& f : hybrid_only.best) EXPECT_EQ(f.l.group(), 8);
}

// Hybrid sharding with experts: each shard group holds whole expert-parallel groups, and
// each share of the experts is sharded over the group's ranks that hold it (g / ep), the
// dense parameters over g: both 64 / 16 times what they are over the whole group.
TEST(Plan, HybridShardingWithExpertsShardsEachShareWithinTheGroup) {
  auto p = llama8b(64);
  p.model.n_experts = 8, p.model.moe_top_k = 2;
  auto whole = make(1, 1, 64, 1, p);
  whole.ep = 8, whole.shard = "parameters";
  auto hybrid = whole;
  hybrid.shard_group = 16;
  ASSERT_EQ(check_layout(p, hybrid), "");
  const auto w = predict(p, whole), h = predict(p, hybrid);
  EXPECT_NEAR(h.memory.optimizer, 4 * w.memory.optimizer, 1e-9 * h.memory.optimizer);
  hybrid.shard_group = 4;  // an expert-parallel group of 8 does not fit in a group of 4
  EXPECT_NE(check_layout(p, hybrid).find("must divide the shard group"), std::string::npos);
}

TEST(Plan, CpuCalibrationTimesTheModelAndScalesItByShape) {
  problem p;
  p.model = model_spec::gpt_tiny().decoder;
  p.model.n_layer = 2;  // (quick)
  p.seq_len = 64, p.global_batch = 8, p.devices = 2;
  p.device = builtin_device("cpu");
  calibrate_cpu(p);
  ASSERT_TRUE(p.device.profile);
  const auto& prof = *p.device.profile;
  EXPECT_GT(prof.forward_fixed + prof.forward_per_sequence, 0);
  EXPECT_GT(prof.backward_per_sequence, 0);
  // Data parallelism halves each rank's sequences; so does tensor parallelism's split of
  // the per-sequence part (up to the norms it leaves whole, and its collectives).
  layout one;
  one.dp = 2, one.micro_batch = 4, one.microbatches = 1;
  const auto d2 = predict(p, one);
  one.micro_batch = 2, one.microbatches = 2;
  const auto d2_small = predict(p, one);
  // Each micro-batch pays the fixed parts once, per layer: two micro-batches of 2 pay them
  // twice (the measured fixed parts may be 0 where the fit finds none, so no strict order).
  const double per_sequence = prof.forward_per_sequence + prof.backward_per_sequence;
  const double fixed = prof.forward_fixed + prof.backward_fixed;
  EXPECT_NEAR(d2.parts.compute, 2 * fixed + 2 * 4 * per_sequence, 1e-9);
  EXPECT_NEAR(d2_small.parts.compute, 2 * 2 * fixed + 2 * 2 * 2 * per_sequence, 1e-9);
  EXPECT_GE(d2_small.parts.compute, d2.parts.compute);
}

// Tensor and expert parallelism on this machine's cores: their slices are timed with the
// group's collectives (ranks on threads of their own), and a layout with that group takes
// those times as they are, with no modelled collective added.
TEST(Plan, CpuCalibrationTimesTensorAndExpertGroups) {
  if (std::thread::hardware_concurrency() < 2) GTEST_SKIP() << "one core: no group of two runs at once";
  problem p;
  p.model = model_spec::gpt_tiny().decoder;
  p.model.n_layer = 2;
  p.seq_len = 64, p.global_batch = 8, p.devices = 2;
  p.device = builtin_device("cpu");
  calibrate_cpu(p, in_process_groups);
  ASSERT_EQ(p.device.group_profiles.count({2, 1}), 1u);
  EXPECT_EQ(p.device.group_profiles.count({1, 2}), 0u);  // (no experts)
  const auto& tp = p.device.group_profiles.at({2, 1});
  EXPECT_GT(tp.forward_fixed + tp.forward_per_sequence, 0);
  layout t2;
  t2.tp = 2, t2.micro_batch = 4, t2.microbatches = 2, t2.sequence_parallel = false;
  const auto got = predict(p, t2);
  EXPECT_EQ(got.parts.tp_comm, 0);  // in the measured times
  EXPECT_NEAR(got.parts.compute,
              2 * 2 * (tp.forward_fixed + tp.backward_fixed) + 2 * 2 * 4 * (tp.forward_per_sequence + tp.backward_per_sequence),
              1e-9);
  // Experts: an expert-parallel group of two, and no tensor-parallel one.
  problem moe = p;
  moe.model = model_spec::moe_tiny().decoder;
  moe.model.n_layer = 2;
  calibrate_cpu(moe, in_process_groups);
  EXPECT_EQ(moe.device.group_profiles.count({1, 2}), 1u);
  EXPECT_EQ(moe.device.group_profiles.count({2, 1}), 0u);
  bool with_groups = false;
  EXPECT_EQ(moe.device.profile_for(1, 2, with_groups), &moe.device.group_profiles.at({1, 2}));
  EXPECT_TRUE(with_groups);
  EXPECT_EQ(moe.device.profile_for(1, 1, with_groups), &*moe.device.profile);
  EXPECT_FALSE(with_groups);
}

TEST(Plan, NetworkFileOverridesLinks) {
  test::temp_dir dir;
  const auto path = dir / "net.toml";
  std::ofstream(path) << "per_node = 4\n[inter]\nbandwidth_gbytes_per_s = 12.5\nlatency_us = 3\n";
  auto d = builtin_device("h100");
  read_network_file(d, path);
  EXPECT_EQ(d.per_node, 4);
  EXPECT_DOUBLE_EQ(d.inter.bandwidth, 12.5e9);
  EXPECT_DOUBLE_EQ(d.inter.latency, 3e-6);
  std::ofstream(path) << "[inter]\nbandwidth = 1\n";
  try {
    read_network_file(d, path);
    FAIL() << "accepted an unknown key";
  } catch (const plan_error& e) {
    EXPECT_NE(std::string(e.what()).find("inter.bandwidth"), std::string::npos) << e.what();
  }
}

std::vector<std::string> split(const std::string& line) {
  std::vector<std::string> out;
  std::stringstream s(line);
  std::string cell;
  while (std::getline(s, cell, ',')) out.push_back(cell);
  return out;
}

TEST(Plan, PublishedRunsWithinTwentyPercent) {
  // tests/support/published_training.csv: each run's step time from its reported TFLOP/s
  // per GPU (counted its source's way) against the planner's prediction of its layout.
  std::ifstream in(std::string(test::source_dir) + "/tests/support/published_training.csv");
  ASSERT_TRUE(in) << "no published_training.csv";
  std::string line;
  std::vector<std::string> head;
  int rows = 0;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    const auto c = split(line);
    if (head.empty()) {
      head = c;
      continue;
    }
    ASSERT_EQ(c.size(), head.size()) << line;
    auto at = [&](const char* name) { return c.at(std::size_t(std::find(head.begin(), head.end(), name) - head.begin())); };
    auto num = [&](const char* name) { return std::stoi(at(name)); };
    problem p;
    auto& m = p.model;
    m.arch = at("arch") == "llama" ? decoder_arch::llama : decoder_arch::gpt2;
    m.n_layer = num("layers"), m.d_model = num("d_model"), m.n_head = num("heads"), m.n_kv_head = num("kv_heads");
    m.d_ff = num("d_ff"), m.vocab = num("vocab"), m.tie_embeddings = m.arch == decoder_arch::gpt2;
    p.seq_len = num("seq"), p.global_batch = num("global_batch"), p.devices = num("devices");
    p.device = builtin_device(at("device"));
    p.device.fused_attention = at("attention") == "fused";
    layout l;
    l.tp = num("tp"), l.pp = num("pp"), l.vp = num("vp"), l.dp = num("dp"), l.cp = num("cp");
    l.micro_batch = num("micro_batch"), l.schedule = parse_schedule_kind(at("schedule"));
    l.recompute = at("recompute") == "full";
    l.microbatches = p.global_batch / (l.dp * l.micro_batch);
    const auto pred = predict(p, l);
    const double B = p.global_batch, s = p.seq_len, L = m.n_layer, h = m.d_model, V = m.vocab;
    const double flops = at("flops") == "megatron"
                             ? 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
                             : model_flops_per_token(m, p.seq_len) * B * s;
    const double published = flops / (std::stod(at("tflops_per_gpu")) * 1e12 * p.devices);
    const double ratio = pred.step_seconds / published;
    std::printf("%s %s on %d %s, %s: published %.2f s, predicted %.2f s (%.2f), %.1f GB per device\n",
                at("source").c_str(), at("model").c_str(), p.devices, at("device").c_str(), l.text().c_str(),
                published, pred.step_seconds, ratio, pred.memory.total() / 1e9);
    EXPECT_NEAR(ratio, 1.0, 0.2) << line;
    if (at("recompute") != "unstated") {  // the layout ran on these devices: it must fit
      EXPECT_TRUE(pred.fits) << line << ": " << pred.memory.total() / 1e9 << " GB";
    }
    ++rows;
  }
  EXPECT_GE(rows, 10);
}

}  // namespace
}  // namespace troupe::plan
