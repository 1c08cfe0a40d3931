// bf16 (on the CPU here, so CI runs it): it follows fp32, stages hold two bytes per
// parameter and compute as before, the bf16 residual stream splits exactly, the bytes
// between stages and of the all-gather halve, retries and resumes are bit-identical.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <fstream>
#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include "actors/runtime.hpp"
#include "compute/checkpoint/checkpoint.hpp"
#include "compute/runtime/device.hpp"
#include "compute/trainer/local_pipeline.hpp"
#include "compute/models/partition.hpp"
#include "compute/trainer/local_trainer.hpp"
#include "gpu_jobs.hpp"
#include "held_bytes.hpp"
#include "test_util.hpp"


namespace troupe {

using namespace gpu_jobs;

namespace {

/// gpu_jobs' tiny() job on the CPU at half gpt-tiny's width and sequence length
/// (test::small_config's): bf16 computes about 15 times slower than fp32 on a CPU without
/// bf16 instructions, and what these tests compare holds at any width.
job_config cpu_tiny(int p, int d, const char* precision = "fp32") {
  auto c = tiny(p, d, 1, "1f1b", "cpu", precision);
  c.d_model = 64;
  c.seq_len = 64;
  return c;
}

/// The model of cpu_tiny's jobs.
model_spec cpu_spec() { return cpu_tiny(1, 1).model(); }

}  // namespace

// bf16 compute under autocast (on the CPU here, so CI runs it): every step's loss within
// 2 % of fp32's, and the parameters do differ (bf16 did run).
TEST(Precision, Bf16FollowsFp32OnTheCpu) {
  const int steps = 6;
  auto job = [](const char* precision) {
    auto c = cpu_tiny(2, 1, precision);
    c.eval_interval = 0;  // (the losses are compared)
    return c;
  };
  const auto fp32 = run(job("fp32"), steps);
  const auto bf16 = run(job("bf16"), steps);
  ASSERT_EQ(fp32.exit_code, 0) << fp32.error;
  ASSERT_EQ(bf16.exit_code, 0) << bf16.error;
  ASSERT_EQ(bf16.losses.size(), std::size_t(steps));
  for (int i = 0; i < steps; ++i) EXPECT_NEAR(bf16.losses[i] / fp32.losses[i], 1.0, 0.02) << "step " << i;
  EXPECT_GT(test::max_abs_diff(bf16.final_state, fp32.final_state), 0.0);
  for (const auto& [name, t] : bf16.final_state) EXPECT_EQ(t.scalar_type(), torch::kFloat32) << name;
  // The same with an fp32 residual stream (fp32_residual = true; bf16 jobs keep it in
  // bf16 by default): close to both, equal to neither.
  auto c = job("bf16");
  c.fp32_residual = true;
  const auto stream = run(c, steps);
  ASSERT_EQ(stream.exit_code, 0) << stream.error;
  for (int i = 0; i < steps; ++i) EXPECT_NEAR(stream.losses[i] / fp32.losses[i], 1.0, 0.02) << "step " << i;
  EXPECT_GT(test::max_abs_diff(stream.final_state, bf16.final_state), 0.0);
}

// bf16 jobs keep Megatron's split: the stages compute with bf16 parameter values (the
// shards all-gather their main parameters rounded to bf16), the shards keep the fp32 main
// parameters, and those are what --save and the run's result hold.
TEST(Precision, Bf16StagesComputeWithTheMainParametersRoundedToBf16) {
  test::temp_dir dir;
  auto c = cpu_tiny(2, 2, "bf16");
  c.steps = 3;
  c.save = dir / "model.pt";
  c.metrics = dir / "metrics.jsonl";
  c.eval_mode = "gather";  // the model as the stages hold it, evaluated in fp32 (see below)
  const auto got = run(c, c.steps);
  ASSERT_EQ(got.exit_code, 0) << got.error;
  const auto saved = load_state_dict(c.save);
  EXPECT_EQ(test::max_abs_diff(saved, got.final_state), 0.0);
  auto rounded = saved;
  bool all_bf16_values = true;
  for (auto& [name, t] : rounded) {
    t = t.to(torch::kBFloat16).to(torch::kFloat32);
    if (!torch::equal(t, saved_value(saved, name))) all_bf16_values = false;
  }
  EXPECT_FALSE(all_bf16_values) << "the saved parameters are the fp32 main parameters, not the rounded ones";
  // The job's validation loss of its last step is that of the rounded parameters (with
  // eval_mode gather the coordinator evaluates the stages' parameters, fp32 compute, one
  // thread).
  std::ifstream in(c.metrics);
  std::string line;
  double job_val = NAN;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("val_loss")) job_val = j.at("val_loss").get<double>();
  }
  // (One thread, as the coordinator's evaluation; put back for the tests after this one.)
  struct one_thread {
    int before = torch::get_num_threads();
    one_thread() { torch::set_num_threads(1); }
    ~one_thread() { torch::set_num_threads(before); }
  } single;
  const training_data data(c);
  auto eval = [&](const state_dict& sd) {
    local_pipeline model(c.model(), sd, 1);
    return evaluate_model(model, data.evaluation_set(), true, c.steps).loss;
  };
  EXPECT_EQ(job_val, eval(rounded));
  EXPECT_NE(job_val, eval(saved)) << "rounding changes the validation loss (else this test could not fail)";
}

namespace {

bool inside(const torch::Tensor& t, const torch::Tensor& buffer) {
  const auto* p = static_cast<const char*>(t.data_ptr());
  const auto* b = static_cast<const char*>(buffer.data_ptr());
  return p >= b && p + t.nbytes() <= b + buffer.nbytes();
}

/// gpt-tiny as two slices with `param_dtype` parameters made from `init`; two micro-batches
/// forward (bf16 autocast) and backward as stages run them: plain, with full recompute,
/// or with the split backward (every W after both backwards). Returns the gradient of the
/// first micro-batch's activation between the slices and both slices' flat gradients.
std::vector<torch::Tensor> bf16_grads(const state_dict& init, torch::ScalarType param_dtype, const char* mode) {
  const auto spec = cpu_spec();
  const auto ranges = partition_layers(spec.n_layers(), 2);
  auto first = make_slice(spec, ranges[0], init, 1, torch::kCPU, param_dtype);
  auto last = make_slice(spec, ranges[1], init, 1, torch::kCPU, param_dtype);
  const std::string m = mode;
  first->set_recompute(m == "recompute");
  last->set_recompute(m == "recompute");
  std::vector<weight_grad_store> stores(2);
  std::vector<torch::Tensor> out;
  for (std::uint64_t mb = 0; mb < 2; ++mb) {
    torch::manual_seed(mb);
    const auto input = torch::randint(256, {4, spec.decoder.seq_len}, torch::kInt64);
    const auto target = torch::randint(256, {4, spec.decoder.seq_len}, torch::kInt64);
    torch::Tensor act, in, loss;
    {
      precision_scope amp(torch::kCPU, torch::kBFloat16);
      first->defer_weight_grads(m == "split" ? &stores[0] : nullptr);
      last->defer_weight_grads(m == "split" ? &stores[1] : nullptr);
      act = first->forward(input);
      in = act.detach().requires_grad_(true);
      loss = last->loss(last->forward(in), target);
      first->defer_weight_grads(nullptr);
      last->defer_weight_grads(nullptr);
    }
    loss.backward();
    act.backward(in.grad());
    if (mb == 0) out.push_back(in.grad().clone());
  }
  for (auto& s : stores) s.apply();
  out.push_back(first->flat_grads().clone());
  out.push_back(last->flat_grads().clone());
  return out;
}

}  // namespace

// bf16 stages hold 2-byte parameters (Megatron's bf16 model): the flat parameter buffer
// is bf16, the matrix products' weights and biases are views into it, the layer norms and
// embeddings fp32 copies of its values, and every gradient an fp32 view of the gradient
// buffer. Under bf16 autocast such a slice computes exactly what an fp32-parameter slice
// holding the same bf16 values computes (bit for bit: activation gradients and every
// parameter gradient; plain, recomputed and split backwards), and a micro-batch waiting
// for its backward no longer holds a bf16 copy of each weight.
TEST(Precision, Bf16SlicesHoldTwoBytesPerParameterAndComputeAsBefore) {
  const auto spec = cpu_spec();
  const auto init = initial_state(spec, 1234);
  auto rounded = init;
  for (auto& [name, t] : rounded) t = t.to(torch::kBFloat16).to(torch::kFloat32);

  const auto whole = partition_layers(spec.n_layers(), 1)[0];
  auto b = make_slice(spec, whole, init, 4, torch::kCPU, torch::kBFloat16);
  EXPECT_EQ(b->flat_params().scalar_type(), torch::kBFloat16);
  EXPECT_EQ(b->flat_params().nbytes(), b->flat_params().numel() * 2);
  EXPECT_EQ(b->flat_grads().scalar_type(), torch::kFloat32);
  std::int64_t matrix_numel = 0;
  int fp32_copies = 0;
  for (std::size_t i = 0; i < b->entries().size(); ++i) {
    const auto& e = b->entries()[i];
    const auto& p = b->parameters()[i];
    const bool fp32 = e.name.find("ln_") != std::string::npos || e.name == "wte.weight" || e.name == "wpe.weight";
    EXPECT_EQ(p.scalar_type(), fp32 ? torch::kFloat32 : torch::kBFloat16) << e.name;
    EXPECT_EQ(inside(p, b->flat_params()), !fp32) << e.name;
    EXPECT_TRUE(torch::equal(p.to(torch::kFloat32), saved_value(rounded, e.name))) << e.name;
    EXPECT_EQ(p.grad().scalar_type(), torch::kFloat32) << e.name;
    EXPECT_TRUE(inside(p.grad(), b->flat_grads())) << e.name;
    if (fp32) ++fp32_copies;
    if (!fp32 && p.dim() == 2) matrix_numel += p.numel();
  }
  EXPECT_EQ(fp32_copies, 2 + 2 * 2 * spec.n_layers() + 2);  // wte, wpe, ln_1/ln_2 per block, ln_f
  // state() and set_params: fp32 out; in, rounded, the fp32 copies refreshed.
  for (const auto& [name, t] : b->state()) EXPECT_EQ(t.scalar_type(), torch::kFloat32) << name;
  auto other = torch::randn({b->flat_params().numel()});
  b->set_params(other);
  EXPECT_TRUE(torch::equal(b->flat_params(), other.to(torch::kBFloat16)));
  EXPECT_TRUE(torch::equal(b->param("ln_f.weight"),
                           other.narrow(0, b->entries().back().offset - spec.decoder.d_model, spec.decoder.d_model)
                               .to(torch::kBFloat16)
                               .to(torch::kFloat32)))
      << "ln_f.weight's fp32 copy was not refreshed";
  EXPECT_THROW(b->set_params(torch::zeros({3})), model_error);

  for (const char* mode : {"plain", "recompute", "split"}) {
    const auto with_bf16 = bf16_grads(init, torch::kBFloat16, mode);
    const auto with_fp32 = bf16_grads(rounded, torch::kFloat32, mode);
    ASSERT_EQ(with_bf16.size(), with_fp32.size());
    for (std::size_t i = 0; i < with_bf16.size(); ++i) {
      EXPECT_GT(with_fp32[i].abs().sum().item<double>(), 0.0) << mode << " " << i;
      EXPECT_TRUE(torch::equal(with_bf16[i], with_fp32[i]))
          << mode << ": tensor " << i << " differs by up to " << (with_bf16[i] - with_fp32[i]).abs().max().item<double>();
    }
  }

  // Bytes a micro-batch's forward holds for its backward: the fp32-parameter slice's
  // graph keeps a bf16 copy of every matrix weight (autocast's casts), the bf16 one none.
  torch::manual_seed(7);
  const auto input = torch::randint(256, {4, spec.decoder.seq_len}, torch::kInt64);
  const auto target = torch::randint(256, {4, spec.decoder.seq_len}, torch::kInt64);
  auto held = [&](model_slice& slice) { return test::bytes_held_for_backward(slice, input, target, torch::kBFloat16); };
  auto f = make_slice(spec, whole, rounded, 4, torch::kCPU, torch::kFloat32);
  held(*f);  // one-off buffers outside the measure
  held(*b);
  const auto f_held = held(*f), b_held = held(*b);
  std::cout << "bf16 micro-batch of 4 held for its backward: " << f_held << " bytes with fp32 parameters, " << b_held
            << " with bf16 ones (matrix weights: " << matrix_numel * 2 << " bytes in bf16)\n";
  EXPECT_GE(f_held - b_held, matrix_numel * 2 * 95 / 100);
}

namespace {

struct residual_pass {
  double loss = 0;
  torch::ScalarType handed = torch::kFloat32;  ///< the first slice's output dtype
  std::map<std::string, torch::Tensor> grads;  ///< parameters in one slice only, by name
};

/// One micro-batch of `spec` (bf16 parameters from `init`) as `pieces` slices under bf16
/// autocast, with a residual stream in `residual`, forward and backward as stages run it:
/// each hand-off rounded to bf16 and widened to the residual dtype, as a stage sends and
/// receives it.
residual_pass bf16_residual_pass(const model_spec& spec, const state_dict& init, int pieces,
                                 torch::ScalarType residual) {
  std::vector<std::unique_ptr<model_slice>> slices;
  std::map<std::string, int> seen;
  for (const auto& range : partition_layers(spec.n_layers(), pieces)) {
    slices.push_back(make_slice(spec, range, init, 1, torch::kCPU, torch::kBFloat16));
    slices.back()->set_residual_dtype(residual);
    for (const auto& e : slices.back()->entries()) ++seen[e.name];
  }
  torch::manual_seed(3);
  const auto input = torch::randint(256, {2, spec.decoder.seq_len}, torch::kInt64);
  const auto target = torch::randint(256, {2, spec.decoder.seq_len}, torch::kInt64);
  residual_pass r;
  std::vector<torch::Tensor> ins, outs;
  torch::Tensor loss;
  {
    precision_scope amp(torch::kCPU, torch::kBFloat16);
    torch::Tensor x = input;
    for (std::size_t i = 0; i < slices.size(); ++i) {
      if (i > 0) x = x.detach().to(torch::kBFloat16).to(residual).requires_grad_(true);
      ins.push_back(x);
      outs.push_back(slices[i]->forward(x));
      x = outs.back();
    }
    r.handed = outs.front().scalar_type();
    loss = slices.back()->loss(x, target);
  }
  loss.backward();
  for (std::size_t i = slices.size() - 1; i > 0; --i)  // the gradient travels in bf16 too
    outs[i - 1].backward(ins[i].grad().to(torch::kBFloat16).to(outs[i - 1].scalar_type()));
  r.loss = loss.item<double>();
  for (const auto& s : slices)
    for (std::size_t i = 0; i < s->entries().size(); ++i)
      if (seen[s->entries()[i].name] == 1) r.grads[s->entries()[i].name] = s->parameters()[i].grad().clone();
  return r;
}

}  // namespace

// fp32_residual = false (Megatron's bf16 default): the residual stream, the layer norms'
// input and output and the stages' outputs are bf16. It follows the fp32 stream closely
// (the loss within 1 %, every gradient in the same direction), and it makes a pipeline
// split exact: two slices compute bit for bit what one does, because the bf16 hand-off
// rounds nothing, where the fp32 stream's hand-off rounds the activation and its gradient.
TEST(Precision, Bf16ResidualStreamFollowsFp32AndSplitsExactly) {
  for (const auto& spec : {model_spec::gpt_tiny(), model_spec::llama_tiny()}) {
    const auto init = initial_state(spec, 99);
    const auto arch = spec.is_llama() ? "llama-tiny" : "gpt-tiny";
    const auto fp32_one = bf16_residual_pass(spec, init, 1, torch::kFloat32);
    const auto fp32_two = bf16_residual_pass(spec, init, 2, torch::kFloat32);
    const auto bf16_one = bf16_residual_pass(spec, init, 1, torch::kBFloat16);
    const auto bf16_two = bf16_residual_pass(spec, init, 2, torch::kBFloat16);
    EXPECT_EQ(fp32_two.handed, torch::kFloat32) << arch;
    EXPECT_EQ(bf16_two.handed, torch::kBFloat16) << arch;
    EXPECT_NEAR(bf16_one.loss / fp32_one.loss, 1.0, 0.01) << arch;
    EXPECT_NE(bf16_one.loss, fp32_one.loss) << arch << ": the bf16 stream did not change the computation";
    EXPECT_NE(fp32_two.loss, fp32_one.loss) << arch << ": the fp32 stream's hand-off rounds";
    EXPECT_EQ(bf16_two.loss, bf16_one.loss) << arch;
    ASSERT_EQ(bf16_two.grads.size() + (spec.is_llama() ? 0 : 1), bf16_one.grads.size()) << arch;  // (gpt: tied wte)
    for (const auto& [name, g] : bf16_two.grads) {
      const auto& whole = bf16_one.grads.at(name);
      EXPECT_TRUE(torch::equal(g, whole)) << arch << " " << name << " differs by up to "
                                          << (g - whole).abs().max().item<double>();
      const auto& f = fp32_one.grads.at(name);
      const double cosine = (whole * f).sum().item<double>() / (whole.norm() * f.norm()).item<double>();
      EXPECT_GT(cosine, 0.99) << arch << " " << name;
    }
  }
}

// bf16 jobs move half the bytes of fp32 jobs between stages (activations and their
// gradients travel in bf16, as in Megatron's bf16 pipeline) and in the shards' all-gather
// (bf16 parameter values); the reduce-scatter of the fp32 gradient buffers and the tied
// embedding's gradient stay fp32. The trace's `bytes` say so for every event.
TEST(Precision, Bf16HalvesTheBytesBetweenStagesAndOfTheAllGather) {
  auto bytes_of = [](const char* precision) {
    auto c = cpu_tiny(2, 2, precision);
    c.eval_interval = 0;
    const auto got = run(c, 2);
    EXPECT_EQ(got.exit_code, 0) << got.error;
    std::map<std::string, std::set<std::int64_t>> by_name;
    for (const auto& e : got.events)
      if (e.name != "F" && e.name != "B" && e.name != "optimizer") by_name[e.name].insert(e.bytes);
    return by_name;
  };
  const auto fp32 = bytes_of("fp32"), bf16 = bytes_of("bf16");
  const auto c = cpu_tiny(2, 2);
  const auto spec = c.model().decoder;
  const std::int64_t act = std::int64_t(c.microbatch_size()) * spec.seq_len * spec.d_model;
  const std::int64_t tied = std::int64_t(spec.vocab) * spec.d_model;
  for (const char* name : {"send activation", "recv activation", "send gradient", "recv gradient"}) {
    EXPECT_EQ(fp32.at(name), std::set<std::int64_t>{act * 4}) << name;
    EXPECT_EQ(bf16.at(name), std::set<std::int64_t>{act * 2}) << name;
  }
  for (const char* name : {"send tied gradient", "recv tied gradient"}) {
    EXPECT_EQ(fp32.at(name), std::set<std::int64_t>{tied * 4}) << name;
    EXPECT_EQ(bf16.at(name), std::set<std::int64_t>{tied * 4}) << name;
  }
  // Per stage: the whole flat buffer, gradients fp32, gathered parameters bf16.
  ASSERT_EQ(fp32.at("reduce-scatter").size(), 2u);  // the two stages' sizes differ
  EXPECT_EQ(bf16.at("reduce-scatter"), fp32.at("reduce-scatter"));
  std::set<std::int64_t> halves;
  for (auto b : fp32.at("all-gather")) halves.insert(b / 2);
  EXPECT_EQ(fp32.at("all-gather"), fp32.at("reduce-scatter"));
  EXPECT_EQ(bf16.at("all-gather"), halves);
}

// bf16 jobs stay exact under faults: an in-place retry (the stages' parameters rebuilt
// from the shards' fp32 snapshots, then rounded) and a resume from a checkpoint (the fp32
// main parameters) end bit-identical to the uninterrupted bf16 run.
TEST(Precision, Bf16RetriesAndResumesAreBitIdentical) {
  test::temp_dir dir;
  auto c = cpu_tiny(2, 2, "bf16");
  c.steps = 4;
  c.eval_interval = 0;
  const auto straight = run(c, c.steps);
  ASSERT_EQ(straight.exit_code, 0) << straight.error;
  for (const char* fault : {"0:1:2", "1:0:1:late"}) {
    auto f = c;
    f.throw_at = fault;
    f.max_step_retries = 1;
    const auto got = run(f, f.steps);
    ASSERT_EQ(got.exit_code, 0) << fault << ": " << got.error;
    EXPECT_EQ(test::max_abs_diff(got.final_state, straight.final_state), 0.0) << fault;
    EXPECT_EQ(got.losses, straight.losses) << fault;
  }
  auto first = c;
  first.save = dir / "ckpt.pt";
  first.checkpoint_interval = 2;
  first.throw_at = "0:0:2";  // ends the run inside step 2, after the checkpoint of steps 0-1
  first.max_step_retries = 0;
  const auto cut = run(first, first.steps);
  ASSERT_EQ(cut.exit_code, exit_recoverable) << cut.error;
  auto resumed_cfg = c;
  resumed_cfg.load = dir / "ckpt.pt";
  const auto resumed = run(resumed_cfg, resumed_cfg.steps);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.error;
  EXPECT_EQ(test::max_abs_diff(resumed.final_state, straight.final_state), 0.0);
  ASSERT_EQ(resumed.losses.size(), 2u);
  EXPECT_EQ(resumed.losses[0], straight.losses[2]);
  EXPECT_EQ(resumed.losses[1], straight.losses[3]);
}

}  // namespace troupe
