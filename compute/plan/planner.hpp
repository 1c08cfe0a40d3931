#pragma once
// `troupe plan`: which layout to run. A cost model of a device and its links, the bytes
// each layout keeps per device, and the schedule simulator (compute/schedule/) run with
// that model's per-stage op times and transfer times: every layout that fits, ranked by
// predicted step time. No CAF and no tensors (a CPU device is measured with LibTorch).
//
// The model of one step (docs/planning.md names every term and its source):
// - compute: per layer and micro-batch, the matrix products' FLOPs (2 per multiply-add;
//   the backward twice the forward, its weight part half of that) at the device's
//   matrix-product rate plus a fixed time per product, causal attention's FLOPs at the
//   attention rate, and the elementwise work (norms, activations, residuals, rotary) as
//   bytes at the memory bandwidth; full recompute adds a forward to each backward;
// - tensor parallelism: Megatron's collectives per layer (two all-reduces in the forward
//   and two in the backward, or with sequence parallelism the same bytes as all-gathers
//   and reduce-scatters), on the critical path; context parallelism: the ring's
//   key/value blocks, hidden behind attention where it is longer; experts: the dispatch
//   and combine all-to-alls per layer;
// - the pipeline: the schedule simulated op by op with these times, activations and
//   gradients crossing stages over the intra- or inter-node link;
// - data parallelism: the gradients' reduce-scatter and the parameters' all-gather over
//   the data x context group, hidden behind the backward and the next forward except one
//   layer's bucket where `overlap_dp` (Megatron's overlap_grad_reduce and
//   overlap_param_gather); FSDP's per-layer gathers the same way; the optimizer step as
//   bytes at the memory bandwidth. Hybrid sharding (shard_group g): the reduce-scatter
//   within the group of g, an all-reduce of its 1/g across the groups, the all-gather
//   within the group, each over the link its ranks span.
// Memory per device: parameters, gradients (fp32), optimizer state (fp32 main copy and
// two moments) as the shard level divides them (over the shard group), and activations (Korthikanti et al.'s
// bytes per layer, with FlashAttention's) times the schedule's peak micro-batches in
// flight.
#include <cstdint>
#include <map>
#include <optional>
#include <utility>
#include <string>
#include <vector>

#include "compute/models/model_spec.hpp"
#include "compute/parallel/collective_group.hpp"
#include "compute/schedule/schedule.hpp"

namespace troupe::plan {

struct plan_error : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

/// One direction of a link, per device: bytes per second and seconds per message.
struct link_model {
  double bandwidth = 0;
  double latency = 0;
  /// A ring collective over `ranks` moving `bytes` per rank (all-reduce: factor 2,
  /// reduce-scatter or all-gather: 1): factor (ranks-1)/ranks bytes/bandwidth, plus a
  /// latency per ring step.
  double ring(double bytes, int ranks, double factor = 1) const;
  /// A point-to-point message of `bytes`.
  double p2p(double bytes) const { return bytes / bandwidth + latency; }
};

/// A device and the links between devices.
struct device_model {
  std::string name;
  double peak_flops = 0;           ///< dense matrix products in the compute dtype, FLOP/s
  double matmul_efficiency = 0.8;  ///< of peak on large products
  double attention_efficiency = 0.5;  ///< of peak in causal attention (FlashAttention's kernels)
  /// Attention as one fused kernel (FlashAttention: causal, no score matrix in memory);
  /// false: Megatron 2021's products and softmax over the whole score matrix.
  bool fused_attention = true;
  double op_seconds = 0;           ///< fixed time per matrix product (launch, tails)
  double memory_bandwidth = 0;     ///< bytes/s
  double memory_bytes = 0;         ///< usable per device
  int dtype_bytes = 2;             ///< parameters and activations (bf16: 2, fp32: 4)
  int per_node = 8;                ///< devices per node (the intra-node link's domain)
  link_model intra, inter;         ///< NVLink (or shared memory), InfiniBand (or Ethernet)
  /// Data-parallel collectives overlap the backward and the next forward (all but one
  /// layer's bucket).
  bool overlap_dp = true;
  /// Measured op times (calibrate_cpu), per layer for one micro-batch: a fixed part and a
  /// part per sequence at the problem's length. Where set they replace the compute terms
  /// of the model above (the collectives stay modelled).
  struct layer_profile {
    double forward_fixed = 0, forward_per_sequence = 0, backward_fixed = 0, backward_per_sequence = 0;
  };
  std::optional<layer_profile> profile;
  /// Measured with a tensor- or expert-parallel group's ranks on threads of their own, by
  /// (tp, ep): the group's collectives and its ranks' waits for each other are in the
  /// times, so a layout with that group uses them as they are (nothing divided, no
  /// modelled collective added).
  std::map<std::pair<int, int>, layer_profile> group_profiles;
  /// The profile for a layout's tp and ep, and whether it holds their collectives.
  const layer_profile* profile_for(int tp, int ep, bool& with_groups) const;
};

/// h100, h200, a100 (80 GB SXM nodes of 8 with NVLink and 400 or 200 Gb/s InfiniBand per
/// device) or cpu (one core of this machine, measured now: its fp32 matrix-product rate
/// and memory bandwidth). Throws plan_error for another name.
device_model builtin_device(const std::string& name);
/// "h100, h200, a100, cpu".
std::string device_names();
/// Overrides links from a TOML file: per_node, [intra] and [inter] tables with
/// bandwidth_gbytes_per_s and latency_us. Throws plan_error naming the file and key.
void read_network_file(device_model& d, const std::string& path);

/// A layout: the parallel dimensions, the schedule and the batch split.
struct layout {
  int tp = 1, pp = 1, vp = 1, dp = 1, cp = 1, ep = 1;
  std::string shard = "optimizer";  ///< optimizer (ZeRO-1), gradients (ZeRO-2), parameters (ZeRO-3)
  /// Hybrid sharding (HSDP): the state sharded over groups of this many of the dp x cp
  /// ranks, replicated across the groups (0: over all of them).
  int shard_group = 0;
  schedule_kind schedule = schedule_kind::one_f_one_b;
  int micro_batch = 1;   ///< sequences per micro-batch
  int microbatches = 1;  ///< per replica and step
  bool recompute = false;
  bool sequence_parallel = true;  ///< with tp > 1 (Megatron's norms and dropout on sequence shards)
  int devices() const { return tp * pp * dp * cp; }
  /// The ranks one shard group spans: shard_group, or dp x cp.
  int group() const { return shard_group > 0 ? shard_group : dp * cp; }
  bool hybrid() const { return group() < dp * cp; }
  /// The shard level, and "/gN" with hybrid sharding: "parameters/g8".
  std::string shard_label() const;
  std::string text() const;  ///< "tp 8 pp 16 vp 1 dp 128 cp 1 ep 1 optimizer 1f1b mb 1 x 16 recompute none"
};

/// What to train: a decoder's shape, the sequence, the global batch (sequences per step).
struct problem {
  decoder_config model;
  int seq_len = 0;
  int global_batch = 0;
  int devices = 0;
  device_model device;
};

/// The problem's model timed on this machine's cores (LibTorch, the code the stages run,
/// one thread per model): the whole model's forward and backward for micro-batches of 1
/// and 4 sequences, on as many threads at once as the job has devices (up to the cores:
/// a core's speed while the others compute), the median of a few tries, as a
/// layer_profile (a fixed part and a part per sequence, divided over the layers) in
/// p.device. Op times measured, then scaled by shape: tensor and context parallelism
/// divide the per-sequence part. With `groups` (in-process collective groups), the
/// model's tensor-parallel slices (each size up to the devices and cores that the model's
/// heads and widths allow) and, for experts, its expert-parallel slices are timed the same
/// way, each group's ranks on threads of their own: group_profiles.
void calibrate_cpu(problem& p, const group_factory& groups = {});

/// Bytes per device.
struct memory_use {
  double params = 0, grads = 0, optimizer = 0, activations = 0;
  double total() const { return params + grads + optimizer + activations; }
};

/// Seconds of the step's parts (per device on the critical path).
struct step_parts {
  double pipeline = 0;   ///< the simulated schedule's makespan (compute, TP, EP, CP, p2p)
  double compute = 0;    ///< the busiest stage's compute inside it
  double tp_comm = 0;    ///< its tensor-parallel collectives
  double dp_exposed = 0; ///< data-parallel (and FSDP) communication not hidden
  double optimizer = 0;
};

struct prediction {
  layout l;
  double step_seconds = 0;
  double tokens_per_s = 0;
  double mfu = 0;     ///< model FLOPs (6 N + 12 L d S per token) / (devices x peak)
  double bubble = 0;  ///< the schedule's idle share
  memory_use memory;
  bool fits = true;
  step_parts parts;
};

/// Model FLOPs per token: 6 x the matrix products' parameters (the experts': top_k of
/// them) + 12 x layers x d_model x seq_len (attention, PaLM's and Megatron's count).
double model_flops_per_token(const decoder_config& m, int seq_len);
/// Parameters of the model (the experts' all of them).
double parameter_count(const decoder_config& m);

/// Why `l` cannot run `p` ("" when it can): dimensions that do not divide the devices,
/// layers, heads, experts, batch or sequence, or a schedule's rules.
std::string check_layout(const problem& p, const layout& l);
/// The predicted step of `l` (check_layout must pass: throws plan_error otherwise).
prediction predict(const problem& p, const layout& l);

/// The modelled time of each op of a layout: what a simulated run waits
/// (train.compute = "simulated"; actors/simulated/). One virtual stage's, in seconds:
/// per micro-batch its forward, backward and the backward's weight part (what a split
/// backward's W takes), and per step the data-parallel collectives over its parameters
/// (the gradients' reduce-scatter in fp32, the parameters' all-gather) and the optimizer's
/// update of its shard.
struct stage_costs {
  double forward = 0, backward = 0, weight = 0;
  double params = 0;          ///< parameters on one device
  double reduce_scatter = 0, all_gather = 0, optimizer = 0;
  /// The collectives' part that the step waits for: where the device overlaps them with
  /// the backward and the next forward (device_model::overlap_dp), one layer's bucket of
  /// the stage's (as predict counts them); else all of it.
  double reduce_scatter_exposed = 0, all_gather_exposed = 0;
};
struct layout_costs {
  std::vector<stage_costs> chunks;  ///< by virtual stage
  double transfer = 0;              ///< an activation or a gradient between two stages
  prediction predicted;             ///< the whole step as the planner predicts it
};
/// `l`'s op times for `p` (check_layout must pass: throws plan_error otherwise).
layout_costs costs_for(const problem& p, const layout& l);

/// Restrictions of the search: 0 / "" / -1 = any.
struct search_limits {
  int tp = 0, pp = 0, vp = 0, cp = 0, ep = 0, micro_batch = 0;
  int shard_group = -1;  ///< -1: any (the whole group, and a node's worth: per_node / tp); 0: the whole group
  std::string shard, schedule;
  int recompute = -1;
};
struct search_result {
  std::vector<prediction> best;  ///< fastest first, at most `top`
  std::size_t considered = 0;    ///< layouts predicted
  std::size_t fitting = 0;       ///< of them, those that fit
};
/// Every layout within `limits` that fits the device's memory, fastest first. Sharding
/// more or recomputing is tried only where the lighter choice does not fit (neither is
/// faster in this model), zero-bubble only with pp > 1. Each shard level is tried over
/// the whole data-parallel group and, where it spans several nodes, hybrid-sharded over a
/// node's worth of it (per_node / tp ranks, torch's HSDP within a node).
search_result search(const problem& p, const search_limits& limits, int top);

}  // namespace troupe::plan
