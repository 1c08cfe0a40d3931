// `troupe plan` (launch/plan_command.hpp).
#include "launch/plan_command.hpp"

#include <cstdio>
#include <memory>
#include <sstream>

#include <nlohmann/json.hpp>

#include "compute/checkpoint/hf_folder.hpp"
#include "compute/config/job_config.hpp"
#include "actors/tp_groups.hpp"
#include "launch/cli_common.hpp"

namespace troupe_cli {

namespace plan = troupe::plan;

plan_command& add_plan_command(CLI::App& app) {
  static plan_command p;
  p.cmd = app.add_subcommand("plan", "the best layouts of a model on N devices: predicted step time, tokens/s, "
                                     "MFU and memory per device, from the schedule simulated with a device model");
  auto* c = p.cmd;
  c->add_option("--workload", p.workload, "a workload's shape (gpt-tiny, gpt-small, llama-tiny, llama-small, "
                                          "moe-tiny, moe-small, llama3-8b, llama3-70b, llama3-405b, mixtral-8x7b)");
  c->add_option("--model", p.model_dir, "a Hugging Face folder: the shape of its config.json (instead of --workload)");
  c->add_option("--devices", p.devices, "devices (GPUs, or cores for --device cpu)")->required()->check(CLI::PositiveNumber);
  c->add_option("--device", p.device, plan::device_names());
  c->add_option("--per-node", p.per_node, "devices per node (default: the device's, 8 for GPUs)")
      ->check(CLI::PositiveNumber);
  c->add_option("--network", p.network, "a TOML file: per_node, [intra] and [inter] with bandwidth_gbytes_per_s "
                                        "and latency_us");
  c->add_option("--seq-len", p.seq_len, "tokens per sequence (default: the workload's)")->check(CLI::PositiveNumber);
  c->add_option("--global-batch", p.global_batch, "sequences per step (default: the workload's)")
      ->check(CLI::PositiveNumber);
  c->add_option("--attention", p.attention, "fused (FlashAttention, the default) or unfused (the score matrix in "
                                            "memory, as Megatron before FlashAttention)")
      ->check(CLI::IsMember({"fused", "unfused"}));
  c->add_option("--top", p.top, "layouts printed")->check(CLI::PositiveNumber);
  c->add_option("--format", p.format, "table or json")->check(CLI::IsMember({"table", "json"}));
  c->add_option("--tp", p.limits.tp, "only this tensor-parallel width")->check(CLI::PositiveNumber);
  c->add_option("--pp", p.limits.pp, "only this pipeline depth")->check(CLI::PositiveNumber);
  c->add_option("--vp", p.limits.vp, "only this many virtual chunks per stage")->check(CLI::PositiveNumber);
  c->add_option("--cp", p.limits.cp, "only this context-parallel width")->check(CLI::PositiveNumber);
  c->add_option("--ep", p.limits.ep, "only this expert-parallel width")->check(CLI::PositiveNumber);
  c->add_option("--micro-batch", p.limits.micro_batch, "only micro-batches of this many sequences")
      ->check(CLI::PositiveNumber);
  c->add_option("--shard", p.limits.shard, "only this shard level")
      ->check(CLI::IsMember({"optimizer", "gradients", "parameters"}));
  c->add_option("--shard-group", p.limits.shard_group,
                "only this shard group (hybrid sharding over groups of N of the dp x cp ranks; 0: the whole "
                "group); by default both the whole group and a node's worth")
      ->check(CLI::NonNegativeNumber);
  c->add_option("--schedule", p.limits.schedule, "only this schedule");
  c->add_option("--recompute", p.recompute, "only none or full")->check(CLI::IsMember({"none", "full"}));
  return p;
}

namespace {

/// Large shapes for planning only (no weights): Llama 3's 8B, 70B and 405B and Mixtral
/// 8x7B as their config.json files give them.
bool named_shape(const std::string& name, troupe::decoder_config& d, int& seq, int& batch) {
  using troupe::decoder_arch;
  auto llama = [&](int layers, int dm, int heads, int kv, int ff, int vocab) {
    d = {};
    d.n_layer = layers, d.d_model = dm, d.n_head = heads, d.n_kv_head = kv, d.d_ff = ff, d.vocab = vocab;
    d.arch = decoder_arch::llama, d.tie_embeddings = false;
    seq = 8192, batch = 2048;  // Llama 3's 16M-token batches of 8192
  };
  if (name == "llama3-8b") llama(32, 4096, 32, 8, 14336, 128256);
  else if (name == "llama3-70b") llama(80, 8192, 64, 8, 28672, 128256);
  else if (name == "llama3-405b") llama(126, 16384, 128, 8, 53248, 128256);
  else if (name == "mixtral-8x7b") {
    llama(32, 4096, 32, 8, 14336, 32000);
    d.n_experts = 8, d.moe_top_k = 2, seq = 4096, batch = 1024;
  } else
    return false;
  return true;
}

}  // namespace

int run_plan(const plan_command& c) {
  try {
    plan::problem pr;
    int seq = 0, batch = 0;
    if (!c.model_dir.empty()) {
      pr.model = troupe::read_hf_model_shape(c.model_dir).decoder;
      seq = pr.model.seq_len, batch = 256;
    } else if (!named_shape(c.workload, pr.model, seq, batch)) {
      const auto cfg = troupe::job_config::defaults_for(c.workload);
      const auto spec = cfg.model();
      if (spec.type != troupe::model_spec::kind::decoder) return fail(exit_usage, "plan: " + c.workload + " is not a decoder");
      pr.model = spec.decoder;
      seq = pr.model.seq_len, batch = cfg.global_batch;
    }
    pr.seq_len = c.seq_len > 0 ? c.seq_len : seq;
    pr.global_batch = c.global_batch > 0 ? c.global_batch : batch;
    pr.devices = c.devices;
    pr.device = plan::builtin_device(c.device);
    if (!c.network.empty()) plan::read_network_file(pr.device, c.network);
    if (c.per_node > 0) pr.device.per_node = c.per_node;
    if (!c.attention.empty()) pr.device.fused_attention = c.attention == "fused";
    if (pr.device.name == "cpu") plan::calibrate_cpu(pr, troupe::in_process_groups);
    auto limits = c.limits;
    if (!c.recompute.empty()) limits.recompute = c.recompute == "full";
    const auto result = plan::search(pr, limits, c.top);
    const auto& found = result.best;
    if (c.format == "json") {
      auto rows = nlohmann::json::array();
      for (const auto& f : found)
        rows.push_back({{"tp", f.l.tp}, {"pp", f.l.pp}, {"vp", f.l.vp}, {"dp", f.l.dp}, {"cp", f.l.cp},
                        {"ep", f.l.ep}, {"shard", f.l.shard}, {"shard_group", f.l.group()},
                        {"schedule", troupe::to_string(f.l.schedule)},
                        {"micro_batch", f.l.micro_batch}, {"microbatches", f.l.microbatches},
                        {"recompute", f.l.recompute ? "full" : "none"}, {"step_seconds", f.step_seconds},
                        {"tokens_per_s", f.tokens_per_s}, {"mfu", f.mfu}, {"bubble", f.bubble},
                        {"memory_bytes", {{"params", f.memory.params}, {"grads", f.memory.grads},
                                          {"optimizer", f.memory.optimizer}, {"activations", f.memory.activations}}},
                        {"seconds", {{"pipeline", f.parts.pipeline}, {"compute", f.parts.compute},
                                     {"tp_comm", f.parts.tp_comm}, {"dp_exposed", f.parts.dp_exposed},
                                     {"optimizer", f.parts.optimizer}}}});
      std::printf("%s\n", nlohmann::json{{"considered", result.considered}, {"fitting", result.fitting}, {"layouts", rows}}.dump().c_str());
      return 0;
    }
    std::printf("%s: %.3g parameters, seq %d, global batch %d, on %d %s (%d per node): %zu layouts predicted, %zu "
                "fit in %.0f GB\n",
                c.model_dir.empty() ? c.workload.c_str() : c.model_dir.c_str(), plan::parameter_count(pr.model),
                pr.seq_len, pr.global_batch, pr.devices, pr.device.name.c_str(),
                std::min(pr.device.per_node, pr.devices), result.considered, result.fitting,
                pr.device.memory_bytes / 1e9);
    if (found.empty()) return fail(1, "plan: no layout fits (try more devices, a shorter sequence or a smaller batch)");
    std::printf("%-3s %-4s %-4s %-3s %-5s %-3s %-3s %-14s %-16s %-9s %-9s %-10s %-12s %-6s %-7s %s\n", "#", "tp", "pp",
                "vp", "dp", "cp", "ep", "shard", "schedule", "mb x m", "recomp", "step s", "tokens/s", "MFU",
                "bubble", "GB/device (params grads optim act)");
    int i = 0;
    for (const auto& f : found) {
      const auto& m = f.memory;
      const std::string mbm = std::to_string(f.l.micro_batch) + "x" + std::to_string(f.l.microbatches);
      std::printf("%-3d %-4d %-4d %-3d %-5d %-3d %-3d %-14s %-16s %-9s %-9s %-10.4g %-12.4g %-6.3f %-7.3f %.1f "
                  "(%.1f %.1f %.1f %.1f)\n",
                  ++i, f.l.tp, f.l.pp, f.l.vp, f.l.dp, f.l.cp, f.l.ep, f.l.shard_label().c_str(),
                  troupe::to_string(f.l.schedule).c_str(), mbm.c_str(), f.l.recompute ? "full" : "none",
                  f.step_seconds, f.tokens_per_s, f.mfu, f.bubble, m.total() / 1e9, m.params / 1e9, m.grads / 1e9,
                  m.optimizer / 1e9, m.activations / 1e9);
    }
    return 0;
  } catch (const plan::plan_error& e) {
    return fail(exit_usage, std::string("plan: ") + e.what());
  } catch (const troupe::schedule_error& e) {
    return fail(exit_usage, std::string("plan: ") + e.what());
  } catch (const std::exception& e) {
    return fail(exit_usage, std::string("plan: ") + e.what());
  }
}

}  // namespace troupe_cli
