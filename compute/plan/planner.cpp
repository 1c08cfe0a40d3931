// The planner's cost model, memory model and search (compute/plan/planner.hpp).
#include "compute/plan/planner.hpp"

#include <algorithm>
#include <chrono>
#include <functional>
#include <cmath>
#include <map>
#include <sstream>
#include <thread>
#include <tuple>

#include <torch/torch.h>
#include <toml++/toml.h>

#include "compute/models/model.hpp"
#include "compute/models/parameters.hpp"
#include "compute/models/partition.hpp"
#include "compute/models/tensor_parallel_layout.hpp"
#include "compute/schedule/timed_simulation.hpp"

namespace troupe::plan {

double link_model::ring(double bytes, int ranks, double factor) const {
  if (ranks <= 1) return 0;
  return factor * (double(ranks - 1) / ranks * bytes / bandwidth + (ranks - 1) * latency);
}

namespace {

constexpr double giga = 1e9;

/// This machine's core: an fp32 matrix product's rate and a copy's bandwidth, one
/// thread, best of a few tries.
device_model measure_cpu() {
  device_model d;
  d.name = "cpu";
  d.dtype_bytes = 4;
  d.per_node = 1 << 30;  // every "device" a core of one machine: shared memory
  d.overlap_dp = false;  // Troupe's shards exchange after the backward's last bucket
  torch::NoGradGuard no_grad;
  const int threads = torch::get_num_threads();
  torch::set_num_threads(1);
  auto best = [](auto fn) {
    double t = 1e30;
    for (int i = 0; i < 5; ++i) {
      const auto a = std::chrono::steady_clock::now();
      fn();
      t = std::min(t, std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count());
    }
    return t;
  };
  const int n = 384;
  auto a = torch::randn({n, n}), b = torch::randn({n, n}), c = torch::empty({n, n});
  d.peak_flops = 2.0 * n * n * n / best([&] { torch::mm_out(c, a, b); });
  d.matmul_efficiency = 1.0;  // the measured rate is what products of this size get
  d.attention_efficiency = 0.5;
  auto big = torch::randn({8 << 20}), dst = torch::empty({8 << 20});
  d.memory_bandwidth = 2.0 * big.numel() * 4 / best([&] { dst.copy_(big); });
  torch::set_num_threads(threads);
  d.op_seconds = 10e-6;  // LibTorch's dispatch and a CPU kernel's start
  d.memory_bytes = 2.0 * giga;
  d.intra = {d.memory_bandwidth / 4, 20e-6};  // UCX shared memory between node processes
  d.inter = d.intra;
  return d;
}

device_model gpu(const std::string& name, double peak, double hbm_bytes, double hbm_bw, double nvlink, double ib) {
  device_model d;
  d.name = name;
  d.peak_flops = peak;
  // cuBLAS's share of the dense bf16 peak on large products: A100 about 250 of 312
  // TFLOP/s, H100 SXM about 740 of 989.
  d.matmul_efficiency = name == "a100" ? 0.8 : 0.75;
  // FlashAttention-2's causal forward and backward (its paper: up to 73 % of the A100's
  // peak forward, about 35 % of the H100's).
  d.attention_efficiency = name == "a100" ? 0.6 : 0.35;
  d.op_seconds = 4e-6;
  d.memory_bandwidth = hbm_bw * 0.8;
  d.memory_bytes = hbm_bytes * 0.9;  // the CUDA context, allocator slack and workspaces take the rest
  d.dtype_bytes = 2;
  d.per_node = 8;
  d.intra = {nvlink * 0.8, 5e-6};  // NCCL's ring bus bandwidth over NVLink
  d.inter = {ib * 0.8, 10e-6};     // one NIC per GPU
  return d;
}

}  // namespace

device_model builtin_device(const std::string& name) {
  // Bandwidths per direction: NVLink 4 (H100, H200) 450 GB/s, NVLink 3 (A100) 300 GB/s;
  // InfiniBand NDR 400 Gb/s (50 GB/s) and HDR 200 Gb/s (25 GB/s) per GPU.
  if (name == "h100") return gpu(name, 989e12, 80 * giga, 3.35e12, 450 * giga, 50 * giga);
  if (name == "h200") return gpu(name, 989e12, 141 * giga, 4.8e12, 450 * giga, 50 * giga);
  if (name == "a100") return gpu(name, 312e12, 80 * giga, 2.0e12, 300 * giga, 25 * giga);
  if (name == "cpu") return measure_cpu();
  throw plan_error("unknown device '" + name + "' (" + device_names() + ")");
}

std::string device_names() { return "h100, h200, a100, cpu"; }

namespace {

/// One rank of a timed group: its slice and whether its group computes the same tokens.
using slice_maker = std::function<std::unique_ptr<model_slice>(int rank, std::shared_ptr<collective_group> member)>;

/// The model's forward and backward for micro-batches of 1 and 4 sequences, timed on
/// `concurrent` threads at once: concurrent / size groups of `size` ranks (size 1: no
/// group), each rank's slice from `make`. Medians of 7 tries per size, alternating.
device_model::layer_profile time_model(const problem& p, int concurrent, int size, const slice_maker& make,
                                       const group_factory& groups) {
  struct samples {
    std::vector<double> f1, b1, f4, b4;
  };
  const int ranks = std::max(size, concurrent / size * size);
  std::vector<samples> each(static_cast<std::size_t>(ranks));
  std::vector<std::shared_ptr<collective_group>> members;
  for (int g = 0; g < ranks / size; ++g) {
    auto one = size > 1 ? groups(size) : std::vector<std::shared_ptr<collective_group>>(1);
    members.insert(members.end(), one.begin(), one.end());
  }
  std::vector<std::unique_ptr<model_slice>> slices;
  for (int r = 0; r < ranks; ++r) slices.push_back(make(r % size, members[std::size_t(r)]));
  auto run = [&](int r) {
    torch::AutoGradMode grad(true);
    auto& slice = *slices[std::size_t(r)];
    auto& t = each[std::size_t(r)];
    auto once = [&](int sequences, std::vector<double>* forward, std::vector<double>* backward) {
      const auto tokens = torch::randint(0, p.model.vocab, {sequences, p.seq_len}, torch::kInt64);
      const auto a = std::chrono::steady_clock::now();
      auto loss = slice.loss(slice.forward(tokens), tokens);
      const auto b = std::chrono::steady_clock::now();
      loss.backward();
      const auto c = std::chrono::steady_clock::now();
      if (forward) forward->push_back(std::chrono::duration<double>(b - a).count());
      if (backward) backward->push_back(std::chrono::duration<double>(c - b).count());
    };
    once(4, nullptr, nullptr);  // warm-up: first-touch pages, OpenBLAS's buffers
    for (int i = 0; i < 7; ++i) {  // alternating sizes: both see the same moments of the machine
      once(1, &t.f1, &t.b1);
      once(4, &t.f4, &t.b4);
    }
  };
  std::vector<std::thread> pool;
  for (int r = 1; r < ranks; ++r) pool.emplace_back(run, r);
  run(0);
  for (auto& th : pool) th.join();
  auto median = [&](std::vector<double> samples::*field) {
    std::vector<double> all;
    for (const auto& t : each) all.insert(all.end(), (t.*field).begin(), (t.*field).end());
    std::nth_element(all.begin(), all.begin() + long(all.size() / 2), all.end());
    return all[all.size() / 2];
  };
  const double f1 = median(&samples::f1), b1 = median(&samples::b1), f4 = median(&samples::f4), b4 = median(&samples::b4);
  device_model::layer_profile prof;
  const double layers = p.model.n_layer;
  prof.forward_per_sequence = std::max(0.0, (f4 - f1) / 3) / layers;
  prof.forward_fixed = std::max(0.0, f1 / layers - prof.forward_per_sequence);
  prof.backward_per_sequence = std::max(0.0, (b4 - b1) / 3) / layers;
  prof.backward_fixed = std::max(0.0, b1 / layers - prof.backward_per_sequence);
  return prof;
}

}  // namespace

const device_model::layer_profile* device_model::profile_for(int tp, int ep, bool& with_groups) const {
  with_groups = false;
  if (tp > 1 || ep > 1) {
    if (const auto it = group_profiles.find({tp, ep}); it != group_profiles.end()) {
      with_groups = true;
      return &it->second;
    }
  }
  return profile ? &*profile : nullptr;
}

void calibrate_cpu(problem& p, const group_factory& groups) {
  model_spec spec;
  spec.decoder = p.model;
  spec.decoder.seq_len = p.seq_len;
  layer_range whole;
  whole.last = spec.n_layers();
  const auto state = initial_state(spec, 1234);
  const int threads = torch::get_num_threads();
  torch::set_num_threads(1);
  // As many ranks as there are devices (cores) the job uses, each timed on its own thread
  // while the others run: what a core gives when every core computes.
  const int concurrent = std::max(1, std::min<int>(p.devices, int(std::thread::hardware_concurrency())));
  p.device.profile = time_model(p, concurrent, 1, [&](int, auto) { return make_slice(spec, whole, state); }, groups);
  p.device.group_profiles.clear();
  for (int size = 2; groups && size <= concurrent; ++size) {
    bool fits = true;
    try {
      check_tensor_parallel(spec, size, false);
    } catch (const std::exception&) {
      fits = false;
    }
    if (fits && p.model.n_experts == 0)  // (experts with tensor parallelism need sequence parallelism)
      p.device.group_profiles[{size, 1}] = time_model(
          p, concurrent, size,
          [&](int r, std::shared_ptr<collective_group> g) {
            return make_slice(spec, whole, state, 1, torch::kCPU, torch::kFloat32, tensor_parallel{r, size, false, g});
          },
          groups);
    if (p.model.n_experts > 0 && p.model.n_experts % size == 0)
      p.device.group_profiles[{1, size}] = time_model(
          p, concurrent, size,
          [&](int r, std::shared_ptr<collective_group> g) {
            auto s = make_slice(spec, whole, state, 1, torch::kCPU, torch::kFloat32, {}, expert_share{r, size, 1});
            s->set_expert_parallel({r, size, g, nullptr});
            return s;
          },
          groups);
  }
  torch::set_num_threads(threads);
}

void read_network_file(device_model& d, const std::string& path) {
  toml::table doc;
  try {
    doc = toml::parse_file(path);
  } catch (const toml::parse_error& e) {
    std::ostringstream why;
    why << "network file " << path << ": " << e.description() << " (line " << e.source().begin.line << ")";
    throw plan_error(why.str());
  }
  for (const auto& [key, value] : doc) {
    const std::string k(key.str());
    if (k == "per_node") {
      const auto n = value.value<std::int64_t>();
      if (!n || *n < 1) throw plan_error("network file " + path + ": per_node must be a positive integer");
      d.per_node = int(*n);
    } else if (k == "intra" || k == "inter") {
      const auto* t = value.as_table();
      if (!t) throw plan_error("network file " + path + ": [" + k + "] must be a table");
      auto& l = k == "intra" ? d.intra : d.inter;
      for (const auto& [lk, lv] : *t) {
        const std::string name(lk.str());
        const auto x = lv.value<double>();
        if (!x || *x <= 0 || (name != "bandwidth_gbytes_per_s" && name != "latency_us"))
          throw plan_error("network file " + path + ": " + k + "." + name +
                           " (the keys are bandwidth_gbytes_per_s and latency_us, positive numbers)");
        (name == "latency_us" ? l.latency : l.bandwidth) = name == "latency_us" ? *x * 1e-6 : *x * giga;
      }
    } else {
      throw plan_error("network file " + path + ": unknown key '" + k + "' (per_node, [intra], [inter])");
    }
  }
}

std::string layout::shard_label() const {
  return hybrid() ? shard + "/g" + std::to_string(group()) : shard;
}

std::string layout::text() const {
  std::ostringstream o;
  o << "tp " << tp << " pp " << pp << " vp " << vp << " dp " << dp << " cp " << cp << " ep " << ep << " "
    << shard_label()
    << " " << to_string(schedule) << " mb " << micro_batch << " x " << microbatches << " recompute "
    << (recompute ? "full" : "none");
  return o.str();
}

namespace {

struct shape {
  double attn = 0;        ///< one layer's attention products' parameters
  double mlp_active = 0;  ///< one layer's MLP parameters a token multiplies (experts: top_k of them)
  double mlp_dense = 0;   ///< a dense layer's MLP parameters
  double experts = 0;     ///< an expert layer's expert parameters (all of them)
  double f_active = 0;    ///< the MLP's width a token sees (experts: top_k x expert width)
  bool gated = false;
};

shape shape_of(const decoder_config& m) {
  shape s;
  const double d = m.d_model, hd = m.head_dim();
  s.attn = d * hd * (2.0 * m.n_head + 2.0 * m.kv_heads());
  s.gated = m.arch != decoder_arch::gpt2;
  const double k = s.gated ? 3 : 2;
  s.mlp_dense = k * d * m.d_ff;
  if (m.n_experts > 0) {
    s.experts = double(m.n_experts) * 3 * d * m.expert_d_ff();
    s.mlp_active = m.moe_top_k * 3 * d * m.expert_d_ff() + d * m.n_experts;
    s.f_active = double(m.moe_top_k) * m.expert_d_ff();
  } else {
    s.mlp_active = s.mlp_dense;
    s.f_active = m.d_ff;
  }
  return s;
}

int moe_layers(const decoder_config& m, int first, int count) {
  int n = 0;
  for (int i = first; i < first + count; ++i) n += m.is_moe_block(i);
  return n;
}

}  // namespace

double parameter_count(const decoder_config& m) {
  const auto s = shape_of(m);
  const int moe = moe_layers(m, 0, m.n_layer);
  double n = m.n_layer * s.attn + (m.n_layer - moe) * s.mlp_dense + moe * (s.experts + double(m.d_model) * m.n_experts);
  n += double(m.vocab) * m.d_model * (m.tie_embeddings ? 1 : 2);
  return n;
}

double model_flops_per_token(const decoder_config& m, int seq_len) {
  const auto s = shape_of(m);
  const int moe = moe_layers(m, 0, m.n_layer);
  const double products = m.n_layer * s.attn + (m.n_layer - moe) * s.mlp_dense + moe * s.mlp_active +
                          double(m.vocab) * m.d_model;
  return 6 * products + 12.0 * m.n_layer * m.d_model * seq_len;
}

std::string check_layout(const problem& p, const layout& l) {
  const auto& m = p.model;
  std::ostringstream why;
  if (l.tp < 1 || l.pp < 1 || l.vp < 1 || l.dp < 1 || l.cp < 1 || l.ep < 1 || l.micro_batch < 1 || l.microbatches < 1)
    return "every dimension must be at least 1";
  if (l.devices() != p.devices) {
    why << "tp x pp x dp x cp = " << l.devices() << ", not the " << p.devices << " devices";
    return why.str();
  }
  if (m.n_head % l.tp || (m.kv_heads() % l.tp && l.tp % m.kv_heads())) {
    why << "tp " << l.tp << " does not divide the " << m.n_head << " heads and " << m.kv_heads() << " kv heads";
    return why.str();
  }
  if (l.pp * l.vp > m.n_layer) {
    why << "pp x vp = " << l.pp * l.vp << " virtual stages for " << m.n_layer << " layers";
    return why.str();
  }
  if (p.seq_len % (2 * l.cp)) {
    why << "cp " << l.cp << ": the sequence of " << p.seq_len << " is not 2 x cp chunks";
    return why.str();
  }
  if (l.ep > 1 && (m.n_experts == 0 || m.n_experts % l.ep || (l.dp * l.cp) % l.ep)) {
    why << "ep " << l.ep << " must divide the experts (" << m.n_experts << ") and dp x cp (" << l.dp * l.cp << ")";
    return why.str();
  }
  if (std::int64_t(l.dp) * l.micro_batch * l.microbatches != p.global_batch) {
    why << "dp x micro-batch x micro-batches = " << std::int64_t(l.dp) * l.micro_batch * l.microbatches
        << ", not the global batch of " << p.global_batch;
    return why.str();
  }
  if (l.shard != "optimizer" && l.shard != "gradients" && l.shard != "parameters")
    return "shard must be optimizer, gradients or parameters";
  if (l.shard_group < 0 || (l.dp * l.cp) % l.group()) {
    why << "shard group " << l.shard_group << " must divide dp x cp (" << l.dp * l.cp << ")";
    return why.str();
  }
  if (l.hybrid() && l.ep > 1 && l.group() % l.ep) {
    why << "ep " << l.ep << " must divide the shard group (" << l.group() << "): each group holds every expert";
    return why.str();
  }
  try {
    (void)make_schedule(l.schedule, l.pp, l.microbatches, l.vp);
  } catch (const schedule_error& e) {
    return std::string("schedule: ") + e.what();
  }
  if (l.vp > 1 && l.schedule != schedule_kind::interleaved && l.schedule != schedule_kind::combined_1f1b &&
      l.schedule != schedule_kind::zbv && l.schedule != schedule_kind::dualpipev)
    return "vp > 1 needs a schedule with chunks";
  return {};
}

namespace {

/// One virtual stage's work for one micro-batch, in seconds, and its bytes.
struct chunk_cost {
  double forward = 0, backward = 0, weight = 0;  ///< weight: the part of backward that W can take
  double tp = 0;                                 ///< tensor-parallel collectives of F and B
  double params = 0;                             ///< parameters on one device
  double dense_params = 0;                       ///< of them replicated over dp x cp
  double rest_params = 0;                        ///< of them outside the blocks (embedding, output layer)
  int layers = 0;
  double activation_bytes = 0;                   ///< kept per micro-batch in flight
  double recompute_bytes = 0;                    ///< one layer's whole activations while it recomputes
};

struct model_costs {
  std::vector<chunk_cost> chunks;  ///< by virtual stage
  double transfer = 0;             ///< an activation or gradient between stages
  bool transfer_inter = false;
};

model_costs costs_of(const problem& pr, const layout& l) {
  const auto& m = pr.model;
  const auto& dev = pr.device;
  const auto sh = shape_of(m);
  const int t = l.tp, c = l.cp, nv = l.pp * l.vp;
  const bool sp = l.sequence_parallel && t > 1;
  const double b = l.micro_batch, S = pr.seq_len, T = b * S / c, d = m.d_model, hd = m.head_dim();
  const double bytes = dev.dtype_bytes;
  const double rate = dev.peak_flops * dev.matmul_efficiency, attn_rate = dev.peak_flops * dev.attention_efficiency;
  auto link_for = [&](int span) { return span <= dev.per_node ? dev.intra : dev.inter; };
  const auto tp_link = link_for(t);
  // Megatron's ranks: tp fastest, then cp, then dp, then pp.
  const auto cp_link = link_for(t * c);
  const auto ep_link = link_for(t * c * l.ep);

  // One layer, forward: products, attention, elementwise, collectives.
  auto layer = [&](bool moe, double& fwd, double& bwd, double& w, double& tp_s, double& act, double& whole) {
    const double mlp = moe ? sh.mlp_active : sh.mlp_dense, f = moe ? sh.f_active : m.d_ff;
    bool with_groups = false;
    const auto* prof = dev.profile_for(t, l.ep, with_groups);
    const int gemms = 4 + (moe ? 3 * std::max(1, m.n_experts / l.ep) : sh.gated ? 3 : 2);
    const double mm = 2 * T * (sh.attn + mlp) / t / rate + gemms * dev.op_seconds;
    const double heads = double(m.n_head) / t;
    double attn, attn_bwd, scores_bytes = 0;
    if (dev.fused_attention) {
      const double keys = m.sliding_window > 0 ? std::min<double>(m.sliding_window, S / 2) : S / 2;
      attn = 4 * T * keys * hd * heads / attn_rate;
      attn_bwd = 2.5 * attn;  // FlashAttention's backward recomputes the scores
    } else {  // two products over every key, and scale, mask, softmax, dropout over the scores
      scores_bytes = T * S * heads * bytes;
      attn = 4 * T * S * hd * heads / rate + 2 * dev.op_seconds + 6 * scores_bytes / dev.memory_bandwidth;
      attn_bwd = 2 * attn;
    }
    const double elem = (T * (8 * d / (sp ? t : 1) + (sh.gated ? 6 : 4) * f / t)) * bytes / dev.memory_bandwidth;
    double tp = 0;
    if (t > 1) tp = 2 * tp_link.ring(T * d * bytes, t, 2);  // two all-reduces (or AG + RS pairs)
    double cp = 0;
    if (c > 1) {  // the ring's key/value blocks, hidden behind attention where shorter
      const double kv = T * 2 * hd * std::max(1.0, double(m.kv_heads()) / t) * bytes;
      cp = std::max(0.0, (c - 1) * cp_link.p2p(kv) - attn);
    }
    double ep = 0;
    if (moe && l.ep > 1) ep = 2 * (T * m.moe_top_k * d * bytes * (l.ep - 1) / l.ep / ep_link.bandwidth + ep_link.latency);
    fwd = mm + attn + elem + tp + cp + ep;
    w = mm;  // the weights' half of the backward's products
    bwd = 2 * mm + attn_bwd + 2 * elem + tp + 2 * cp + ep;
    if (prof) {
      // Measured. The per-sequence part scales with the sequences (b / cp); tensor
      // parallelism divides the share of it that the model above gives the products,
      // attention and the sharded elementwise work (without sequence parallelism the
      // norms and residuals stay whole on every rank).
      const double norms = T * 8 * d * bytes / dev.memory_bandwidth;  // at tp 1
      const double whole_at_1 = 2 * T * (sh.attn + mlp) / rate + attn * t + norms +
                                T * (sh.gated ? 6 : 4) * f * bytes / dev.memory_bandwidth;
      // A profile measured with the layout's groups has their collectives in it.
      const double split_share = sp ? 1.0 : 1 - norms / whole_at_1;
      const double seqs = b / double(c), tp_factor = with_groups ? 1.0 : split_share / t + (1 - split_share);
      const double f_c = prof->forward_fixed + prof->forward_per_sequence * seqs * tp_factor;
      const double b_c = prof->backward_fixed + prof->backward_per_sequence * seqs * tp_factor;
      if (with_groups) tp = ep = 0;
      fwd = f_c + tp + cp + ep;
      w = b_c * mm / (2 * mm + attn_bwd + 2 * elem);  // the products' weight half of it
      bwd = b_c + tp + 2 * cp + ep;
    }
    if (l.recompute) bwd += fwd;
    tp_s = 2 * tp;
    const double sharded = 5 * d + (sh.gated ? 3 : 2) * f, replicated = 3 * d;
    whole = T * bytes * (sp ? (sharded + replicated) / t : sharded / t + replicated) +
            2.5 * scores_bytes;  // the softmax's output and dropout's (Korthikanti's 5 a s^2 b)
    act = l.recompute ? T * d / (sp ? t : 1) * bytes : whole;
  };

  model_costs out;
  out.chunks.resize(nv);
  const int base = m.n_layer / nv, extra = m.n_layer % nv;
  int first = 0;
  for (int x = 0; x < nv; ++x) {
    auto& cc = out.chunks[x];
    // Left-over layers go to the middle stages (the first has the embedding, the last the
    // output layer and the loss).
    cc.layers = base + (x >= 1 && x <= extra ? 1 : 0) + (nv == 1 ? extra : 0);
    for (int i = first; i < first + cc.layers; ++i) {
      double f, bw, w, tp, act, whole;
      const bool moe = m.is_moe_block(i);
      layer(moe, f, bw, w, tp, act, whole);
      if (l.recompute) cc.recompute_bytes = std::max(cc.recompute_bytes, whole);
      cc.forward += f;
      cc.backward += bw;
      cc.weight += w;
      cc.tp += tp;
      cc.activation_bytes += act;
      cc.dense_params += sh.attn / t + (moe ? d * m.n_experts : sh.mlp_dense / t);
      if (moe) cc.params += sh.experts / l.ep;
    }
    cc.params += cc.dense_params;
    first += cc.layers;
    // The embedding on the first stage; the output layer (or the tied embedding's copy) on the last.
    const int tables = (x == 0) + (x == nv - 1 && (nv > 1 || !m.tie_embeddings));
    cc.dense_params += tables * double(m.vocab) * d / t;
    cc.params += tables * double(m.vocab) * d / t;
    cc.rest_params = tables * double(m.vocab) * d / t;
    if (x == 0 && !dev.profile) cc.forward += T * d * bytes * 2 / dev.memory_bandwidth;
    if (x == nv - 1 && !dev.profile) {  // output layer and cross-entropy (fp32 logits; a profile has them in its layers')
      const double mm = 2 * T * d * m.vocab / t / rate + dev.op_seconds;
      const double ce = T * double(m.vocab) / t * 4 * 3 / dev.memory_bandwidth;
      cc.forward += mm + ce;
      cc.backward += 2 * mm + ce;
      cc.weight += mm;
    }
    if (x == nv - 1) cc.activation_bytes += T * double(m.vocab) / t * 4 * 2;
  }
  const double act_bytes = T * d * bytes / (sp ? t : 1);
  const int span = t * c * l.dp;
  out.transfer_inter = span >= dev.per_node;
  out.transfer = (out.transfer_inter ? dev.inter : dev.intra).p2p(act_bytes);
  return out;
}

/// The data-parallel terms of `params` parameters (of them `dense` replicated over dp x cp,
/// the rest experts) that `layers` layers hold: the gradients' reduce-scatter (fp32) and
/// the parameters' all-gather over the data x context group, each whole and as much as the
/// step waits for (overlap_dp: one layer's bucket), and the optimizer's update of the shard.
struct dp_terms {
  double reduce_scatter = 0, all_gather = 0, exposed = 0, optimizer = 0;
  double hidden = 1;    ///< the share of the collectives the step waits for
  double shard_of = 0;  ///< the parameters of one data-parallel rank's shard
};
dp_terms dp_terms_of(const problem& pr, const layout& l, double params, double dense, int layers) {
  const auto& dev = pr.device;
  const int dc = l.dp * l.cp, g = l.group();
  const auto link_of = [&](int ranks) { return l.tp * ranks <= dev.per_node ? dev.intra : dev.inter; };
  dp_terms t;
  // Hybrid sharding: a reduce-scatter within the shard group (g consecutive ranks), then
  // an all-reduce of the piece across the dc / g groups; the all-gather within the group.
  t.reduce_scatter = link_of(g).ring(params * 4, g) + link_of(dc).ring(params * 4 / g, dc / g, 2);
  t.all_gather = link_of(g).ring(params * dev.dtype_bytes, g);
  t.hidden = dev.overlap_dp ? 1.0 / std::max(1, layers) : 1.0;
  t.exposed = (t.reduce_scatter + t.all_gather) * t.hidden;
  // Expert parameters are replicated over dc / ep devices, the others over dc; each
  // sharded over its replicas in the shard group (hybrid: g and g / ep of them).
  t.shard_of = dense / g + (params - dense) * l.ep / g;
  t.optimizer = t.shard_of * (4 + 12 + 12 + dev.dtype_bytes) / dev.memory_bandwidth;
  return t;
}

struct schedule_cache {
  std::map<std::tuple<int, int, int, int>, schedule> schedules;
  const schedule& get(schedule_kind k, int p, int m, int v) {
    const auto key = std::make_tuple(int(k), p, m, v);
    auto it = schedules.find(key);
    if (it == schedules.end()) it = schedules.emplace(key, make_schedule(k, p, m, v)).first;
    return it->second;
  }
};

prediction predict_with(const problem& pr, const layout& l, schedule_cache& cache) {
  const auto why = check_layout(pr, l);
  if (!why.empty()) throw plan_error("layout " + l.text() + ": " + why);
  const auto& m = pr.model;
  const auto& dev = pr.device;
  const auto mc = costs_of(pr, l);
  const auto& sched = cache.get(l.schedule, l.pp, l.microbatches, l.vp);
  timed_costs tc;
  const bool split = sched.split_backward();
  tc.op = [&](int stage, const pipeline_op& op) {
    const auto& cc = mc.chunks[std::size_t(sched.virtual_stage(stage, op.chunk))];
    if (op.kind == op_kind::forward) return cc.forward;
    if (op.kind == op_kind::weight) return cc.weight;
    return split && op.split ? cc.backward - cc.weight : cc.backward;
  };
  tc.transfer = [&](int, int) { return mc.transfer; };
  const auto sim = simulate(sched, tc);

  prediction out;
  out.l = l;
  out.bubble = sim.bubble;
  out.parts.pipeline = sim.makespan;
  // The busiest stage: its compute and collectives, its parameters, its memory.
  const bool shard_grads = l.shard != "optimizer", shard_params = l.shard == "parameters";
  double worst_mem = -1;
  for (int r = 0; r < l.pp; ++r) {
    double params = 0, dense = 0, chunk_max = 0, act = 0, recomputing = 0, busy_compute = 0, tp = 0;
    double rest_max = 0, block_max = 0;  // (FSDP by blocks: a chunk's rest, one block)
    int layers = 0;
    for (int k = 0; k < l.vp; ++k) {
      const auto& cc = mc.chunks[std::size_t(sched.virtual_stage(r, k))];
      params += cc.params;
      dense += cc.dense_params;
      chunk_max = std::max(chunk_max, cc.params);
      rest_max = std::max(rest_max, cc.rest_params);
      if (cc.layers > 0) block_max = std::max(block_max, (cc.params - cc.rest_params) / cc.layers);
      act = std::max(act, cc.activation_bytes);
      recomputing = std::max(recomputing, cc.recompute_bytes);
      busy_compute += l.microbatches * (cc.forward + cc.backward);
      tp += l.microbatches * cc.tp;
      layers += cc.layers;
    }
    const auto dpt = dp_terms_of(pr, l, params, dense, layers);
    const double shard_of = dpt.shard_of;
    memory_use mem;
    // Parameters sharded, by blocks (parallel.fsdp_unit's default, which the planner
    // models): the chunk's rest gathered while the stage's ops are on it, the block
    // computing and the next one's, prefetched beside it (parallel.fsdp_prefetch);
    // gradients: the rest's and one block's (split backwards: every block's until the
    // run of ops on the chunk ends, a chunk's).
    mem.params = (shard_params ? shard_of + rest_max + 2 * block_max : params) * dev.dtype_bytes;
    mem.grads = (shard_grads ? shard_of + (split ? chunk_max : rest_max + block_max) : params) * 4;
    mem.optimizer = shard_of * 12;  // fp32 main copy, two moments
    mem.activations = act * sim.peak_activations[std::size_t(r)] + recomputing;
    if (mem.total() > worst_mem) {
      worst_mem = mem.total();
      out.memory = mem;
    }
    if (dpt.exposed + dpt.optimizer > out.parts.dp_exposed + out.parts.optimizer) {
      out.parts.dp_exposed = dpt.exposed;
      out.parts.optimizer = dpt.optimizer;
    }
    if (busy_compute > out.parts.compute) {
      out.parts.compute = busy_compute;
      out.parts.tp_comm = tp;
    }
  }
  out.step_seconds = sim.makespan + out.parts.dp_exposed + out.parts.optimizer;
  const double tokens = double(pr.global_batch) * pr.seq_len;
  out.tokens_per_s = tokens / out.step_seconds;
  out.mfu = model_flops_per_token(m, pr.seq_len) * out.tokens_per_s / (double(pr.devices) * dev.peak_flops);
  out.fits = out.memory.total() <= dev.memory_bytes;
  return out;
}

std::vector<int> powers_of_two_upto(int n) {
  std::vector<int> v;
  for (int x = 1; x <= n; x *= 2) v.push_back(x);
  return v;
}

}  // namespace

layout_costs costs_for(const problem& pr, const layout& l) {
  layout_costs out;
  out.predicted = predict(pr, l);  // (checks the layout)
  const auto mc = costs_of(pr, l);
  for (const auto& cc : mc.chunks) {
    stage_costs sc;
    sc.forward = cc.forward;
    sc.backward = cc.backward;
    sc.weight = cc.weight;
    sc.params = cc.params;
    // (the step waits for one layer's bucket of the stage's, whose chunks are alike)
    const auto dpt = dp_terms_of(pr, l, cc.params, cc.dense_params, cc.layers * l.vp);
    sc.reduce_scatter = dpt.reduce_scatter;
    sc.all_gather = dpt.all_gather;
    sc.optimizer = dpt.optimizer;
    sc.reduce_scatter_exposed = dpt.reduce_scatter * dpt.hidden;
    sc.all_gather_exposed = dpt.all_gather * dpt.hidden;
    out.chunks.push_back(sc);
  }
  out.transfer = mc.transfer;
  return out;
}

prediction predict(const problem& p, const layout& l) {
  schedule_cache cache;
  return predict_with(p, l, cache);
}

search_result search(const problem& p, const search_limits& lim, int top) {
  if (p.devices < 1) throw plan_error("devices must be at least 1");
  if (p.global_batch < 1 || p.seq_len < 1) throw plan_error("the global batch and sequence length must be positive");
  schedule_cache cache;
  std::vector<prediction> found;
  std::size_t n = 0;
  const auto& m = p.model;
  auto allowed = [](int limit, int x) { return limit == 0 || limit == x; };
  std::vector<std::string> shards = {"optimizer", "gradients", "parameters"};
  for (int tp : powers_of_two_upto(std::min(p.device.per_node, p.devices))) {
    if (!allowed(lim.tp, tp)) continue;
    for (int cp : powers_of_two_upto(p.devices / tp)) {
      if (!allowed(lim.cp, cp)) continue;
      for (int pp = 1; pp <= std::min(m.n_layer, p.devices / (tp * cp)); ++pp) {
        if (!allowed(lim.pp, pp) || (p.devices / (tp * cp)) % pp) continue;
        const int dp = p.devices / (tp * cp * pp);
        if (tp * cp * pp * dp != p.devices) continue;
        for (int vp : {1, 2, 4, 8}) {
          if (!allowed(lim.vp, vp) || pp * vp > m.n_layer || (vp > 1 && pp == 1)) continue;
          std::vector<schedule_kind> kinds;
          if (lim.schedule.empty()) {
            if (vp == 1) kinds = {schedule_kind::one_f_one_b};
            if (vp == 1 && pp > 1) kinds.push_back(schedule_kind::zero_bubble);
            if (vp > 1) kinds = {schedule_kind::interleaved};
            if (vp == 2) kinds.push_back(schedule_kind::zbv);
          } else {
            kinds = {parse_schedule_kind(lim.schedule)};
          }
          for (auto kind : kinds) {
            for (int ep : powers_of_two_upto(std::max(1, m.n_experts))) {
              if (!allowed(lim.ep, ep)) continue;
              for (int mb : {1, 2, 4, 8}) {
                if (!allowed(lim.micro_batch, mb)) continue;
                if (p.global_batch % (dp * mb)) continue;
                const int micro = p.global_batch / (dp * mb);
                if (micro > 1024) continue;
                // Sharding more or recomputing only where the lighter choice does not fit
                // (they are never faster in this model).
                bool fitted = false;
                for (int rc = 0; rc <= 1 && !fitted; ++rc) {
                  if (lim.recompute >= 0 && lim.recompute != rc) continue;
                  for (const auto& shard : shards) {
                    if (fitted) break;
                    if (!lim.shard.empty() && lim.shard != shard) continue;
                    // The whole group, and a node's worth of it where it spans nodes.
                    std::vector<int> groups{0};
                    const int node_group = std::max(1, p.device.per_node / tp);
                    if (node_group < dp * cp && (dp * cp) % node_group == 0) groups.push_back(node_group);
                    if (lim.shard_group >= 0) groups = {lim.shard_group};
                    for (const int g : groups) {
                      layout l;
                      l.tp = tp, l.pp = pp, l.vp = vp, l.dp = dp, l.cp = cp, l.ep = ep, l.shard = shard;
                      l.shard_group = g;
                      l.schedule = kind, l.micro_batch = mb, l.microbatches = micro, l.recompute = rc == 1;
                      if (!check_layout(p, l).empty()) continue;
                      ++n;
                      auto pred = predict_with(p, l, cache);
                      if (!pred.fits) continue;
                      fitted = true;  // (a heavier level after both groupings of this one)
                      found.push_back(std::move(pred));
                    }
                  }
                }
              }
            }
          }
        }
      }
    }
  }
  std::sort(found.begin(), found.end(),
            [](const prediction& a, const prediction& b) { return a.step_seconds < b.step_seconds; });
  search_result out;
  out.considered = n;
  out.fitting = found.size();
  if (top > 0 && found.size() > std::size_t(top)) found.resize(std::size_t(top));
  out.best = std::move(found);
  return out;
}

}  // namespace troupe::plan
