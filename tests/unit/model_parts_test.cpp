// The parts a decoder is composed of (compute/models/parts/), each against its formula
// written out in plain LibTorch, and the design's test: a family is a table, so a new
// family of the same parts is a new table that composes and runs.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "compute/models/block.hpp"
#include "compute/models/family.hpp"
#include "compute/models/parts/attention.hpp"
#include "compute/models/parts/experts.hpp"
#include "compute/models/parts/mlp.hpp"
#include "compute/models/parts/norm.hpp"
#include "compute/models/parts/positions.hpp"

namespace troupe {
namespace {

/// Parameters by name for the parts, drawn at random from their table's shapes (biases
/// and norms too, so that a part that leaves one out shows).
struct param_map : named_parameters {
  std::map<std::string, torch::Tensor> m;
  param_map(const param_table& table, std::uint64_t seed) {
    torch::manual_seed(seed);
    for (const auto& p : table) m[p.name] = torch::randn(p.shape) * 0.3;
  }
  torch::Tensor& param(const std::string& name) override {
    const auto it = m.find(name);
    if (it == m.end()) throw model_error("no parameter " + name);
    return it->second;
  }
};

decoder_config small_llama() {
  decoder_config c;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_kv_head = 2;
  c.d_model = 16;
  c.d_ff = 24;
  c.seq_len = 8;
  c.vocab = 32;
  c.arch = decoder_arch::llama;
  return c;
}

decoder_config small_gpt() {
  decoder_config c = small_llama();
  c.n_kv_head = 0;
  c.arch = decoder_arch::gpt2;
  return c;
}

struct parts_fixture {
  decoder_config cfg;
  const decoder_family& family;
  param_map params;
  tensor_parallel tp;  // (inactive)
  parts_fixture(const decoder_config& c, const param_table& table)
      : cfg(c), family(family_of(c.arch)), params(table, 7) {}
  part_context context() {
    return part_context{family, cfg, params, nullptr, tp, false, block_pass::plain, cfg.n_head, cfg.kv_heads()};
  }
};

torch::Tensor plain_linear(param_map& p, const std::string& name, const torch::Tensor& x, bool bias) {
  auto y = torch::matmul(x, p.m.at(name + ".weight").t());
  return bias ? y + p.m.at(name + ".bias") : y;
}

/// softmax(q k^T / sqrt(hd) + causal mask) v, key/value heads repeated for the groups.
torch::Tensor plain_attention(const torch::Tensor& q, torch::Tensor k, torch::Tensor v, std::int64_t past) {
  const auto T = q.size(2), hd = q.size(3);
  k = k.repeat_interleave(q.size(1) / k.size(1), 1);
  v = v.repeat_interleave(q.size(1) / v.size(1), 1);
  auto s = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(double(hd));
  const auto allowed = torch::ones({past + T, past + T}, torch::kBool).tril().narrow(0, past, T);
  s = s.masked_fill(allowed.logical_not(), -INFINITY);
  return torch::matmul(torch::softmax(s, -1), v);
}

std::vector<std::string> names(const param_table& t) {
  std::vector<std::string> out;
  for (const auto& p : t) out.push_back(p.name);
  return out;
}

}  // namespace

TEST(ModelParts, NormsAreLayerNormAndRmsNorm) {
  for (auto arch : {decoder_arch::gpt2, decoder_arch::llama}) {
    auto cfg = arch == decoder_arch::gpt2 ? small_gpt() : small_llama();
    parts_fixture f(cfg, norm_params(family_of(arch).norm, "n", cfg.d_model));
    const auto x = torch::randn({2, 3, cfg.d_model});
    const auto& w = f.params.m.at("n.weight");
    torch::Tensor expected;
    if (arch == decoder_arch::gpt2) {
      ASSERT_EQ(f.params.m.count("n.bias"), 1u);
      const auto mean = x.mean(-1, true), var = (x - mean).pow(2).mean(-1, true);
      expected = (x - mean) / torch::sqrt(var + cfg.norm_eps) * w + f.params.m.at("n.bias");
    } else {
      ASSERT_EQ(f.params.m.count("n.bias"), 0u);
      expected = x * torch::rsqrt(x.pow(2).mean(-1, true) + cfg.norm_eps) * w;
    }
    EXPECT_TRUE(torch::allclose(norm(f.context(), x, "n"), expected, 1e-5, 1e-5)) << decoder_arch_name(arch);
  }
}

TEST(ModelParts, PositionsAreALearnedTableOrRotations) {
  const auto cfg = small_llama();
  const auto table = torch::randn({cfg.seq_len, cfg.d_model});
  const auto x = torch::randn({2, 3, cfg.d_model});
  EXPECT_TRUE(torch::equal(add_learned_positions(x, table, 2, torch::kCPU), x + table.narrow(0, 2, 3)));
  EXPECT_EQ(learned_position_params("wpe.weight", 8, 16).front().shape, (std::vector<std::int64_t>{8, 16}));

  const rotary_embedding rope(cfg, torch::kCPU);
  const std::int64_t hd = cfg.head_dim(), half = hd / 2;
  const auto q = torch::randn({1, 2, cfg.seq_len, hd});
  const auto all = rope.rotate(q, 0);
  // Position 0 is not rotated; positions 5.. of a later call are the rows 5.. of the whole.
  EXPECT_TRUE(torch::allclose(all.narrow(2, 0, 1), q.narrow(2, 0, 1)));
  EXPECT_TRUE(torch::allclose(rope.rotate(q.narrow(2, 5, 3), 5), all.narrow(2, 5, 3), 1e-6, 1e-6));
  // Pair (j, j + hd/2) of position t turns by t / theta^(2j / hd).
  const int t = 3, j = 1;
  const double angle = t / std::pow(cfg.rope_theta, 2.0 * j / double(hd));
  const double a = q[0][0][t][j].item<double>(), b = q[0][0][t][j + half].item<double>();
  EXPECT_NEAR(all[0][0][t][j].item<double>(), a * std::cos(angle) - b * std::sin(angle), 1e-5);
  EXPECT_NEAR(all[0][0][t][j + half].item<double>(), b * std::cos(angle) + a * std::sin(angle), 1e-5);
}

// Llama 3.1's scaling of the rotary frequencies (the values transformers 5's
// _compute_llama3_parameters gives for head_dim 16, theta 5e5, factor 8, low 1, high 4,
// 8192 original positions), and linear scaling: every frequency divided.
TEST(ModelParts, RotaryFrequenciesAreScaledAsLlama3AndLinear) {
  auto cfg = small_llama();
  cfg.head_size = 16;
  cfg.rope_theta = 5e5;
  cfg.seq_len = 4;
  const std::vector<double> llama3{1.0,           0.193922758,    0.0376060307,   0.00729266508,
                                   0.000524846022, 3.42810235e-05, 6.64786967e-06, 1.28917316e-06};
  auto expect_frequencies = [&](const std::vector<double>& inv_freq, const char* what) {
    const rotary_embedding rope(cfg, torch::kCPU);
    const auto q = torch::randn({1, 1, cfg.seq_len, 16});
    const auto got = rope.rotate(q, 0);
    for (int t = 0; t < cfg.seq_len; ++t)
      for (int j = 0; j < 8; ++j) {
        const double angle = t * inv_freq[std::size_t(j)];
        const double a = q[0][0][t][j].item<double>(), b = q[0][0][t][j + 8].item<double>();
        EXPECT_NEAR(got[0][0][t][j].item<double>(), a * std::cos(angle) - b * std::sin(angle), 1e-5) << what << t << j;
        EXPECT_NEAR(got[0][0][t][j + 8].item<double>(), b * std::cos(angle) + a * std::sin(angle), 1e-5) << what << t << j;
      }
  };
  cfg.rope = {rope_scaling::kind::llama3, 8, 1, 4, 8192};
  expect_frequencies(llama3, "llama3 ");
  cfg.rope = {rope_scaling::kind::linear, 2};
  std::vector<double> linear;
  for (int j = 0; j < 8; ++j) linear.push_back(1 / std::pow(5e5, 2.0 * j / 16) / 2);
  expect_frequencies(linear, "linear ");
}

// Mistral's sliding window: query i sees keys i - window + 1 .. i, with a cache too.
TEST(ModelParts, ASlidingWindowHidesTheKeysBeforeIt) {
  const std::int64_t T = 8, window = 3;
  const causal_attention core(T, torch::kCPU, window);
  const auto q = torch::randn({1, 2, T, 4}), k = torch::randn({1, 2, T, 4}), v = torch::randn({1, 2, T, 4});
  auto att = torch::matmul(q, k.transpose(-2, -1)) / 2.0;
  const auto i = torch::arange(T).unsqueeze(1), j = torch::arange(T).unsqueeze(0);
  att = att.masked_fill((j > i).logical_or(j <= i - window), -INFINITY);
  const auto expected = torch::matmul(torch::softmax(att, -1), v);
  EXPECT_TRUE(torch::allclose(core(q, k, v, 0), expected, 1e-5, 1e-5));
  // One new token after 6 cached keys sees only the last 3 keys.
  EXPECT_TRUE(torch::allclose(core(q.narrow(2, 6, 1), k.narrow(2, 0, 7), v.narrow(2, 0, 7), 6), expected.narrow(2, 6, 1),
                              1e-5, 1e-5));
  // A window as long as the sequence is plain causal attention.
  const causal_attention whole(T, torch::kCPU, T);
  EXPECT_TRUE(torch::allclose(whole(q, k, v, 0), plain_attention(q, k, v, 0), 1e-5, 1e-5));
}

// Qwen2's biases on q, k and v (not on o); Qwen3's RMSNorm of each head's q and k before
// the rotary embedding, and a head_dim of its own.
TEST(ModelParts, QwenAttentionHasBiasesOrHeadNorms) {
  auto cfg = small_llama();
  const auto& q2 = family_of(decoder_arch::qwen2);
  EXPECT_EQ(names(attention_params(q2, cfg, "b.")),
            (std::vector<std::string>{"b.self_attn.q_proj.weight", "b.self_attn.q_proj.bias", "b.self_attn.k_proj.weight",
                                      "b.self_attn.k_proj.bias", "b.self_attn.v_proj.weight", "b.self_attn.v_proj.bias",
                                      "b.self_attn.o_proj.weight"}));
  cfg.head_size = 6;  // 4 heads of 6 over d_model 16
  cfg.arch = decoder_arch::qwen3;
  const auto& q3 = family_of(decoder_arch::qwen3);
  const auto table = attention_params(q3, cfg, "b.");
  EXPECT_EQ(names(table), (std::vector<std::string>{"b.self_attn.q_proj.weight", "b.self_attn.k_proj.weight",
                                                    "b.self_attn.v_proj.weight", "b.self_attn.q_norm.weight",
                                                    "b.self_attn.k_norm.weight", "b.self_attn.o_proj.weight"}));
  EXPECT_EQ(table[0].shape, (std::vector<std::int64_t>{24, 16}));
  EXPECT_EQ(table[3].shape, (std::vector<std::int64_t>{6}));
  EXPECT_EQ(table[5].shape, (std::vector<std::int64_t>{16, 24}));
  parts_fixture f(cfg, table);
  const causal_attention core(cfg.seq_len, torch::kCPU);
  const attention_core plain = [&](const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& c,
                                   std::int64_t past) { return core(a, b, c, past); };
  const rotary_embedding rope(cfg, torch::kCPU);
  const auto x = torch::randn({2, 5, cfg.d_model});
  auto heads = [](const torch::Tensor& t, std::int64_t n) { return t.view({2, 5, n, 6}).transpose(1, 2); };
  auto rms = [&](const torch::Tensor& t, const std::string& w) {
    return t * torch::rsqrt(t.pow(2).mean(-1, true) + cfg.norm_eps) * f.params.m.at(w);
  };
  const auto qe = rope.rotate(rms(heads(plain_linear(f.params, "b.self_attn.q_proj", x, false), 4), "b.self_attn.q_norm.weight"), 0);
  const auto ke = rope.rotate(rms(heads(plain_linear(f.params, "b.self_attn.k_proj", x, false), 2), "b.self_attn.k_norm.weight"), 0);
  const auto ve = heads(plain_linear(f.params, "b.self_attn.v_proj", x, false), 2);
  const auto ye = plain_attention(qe, ke, ve, 0).transpose(1, 2).reshape({2, 5, 24});
  EXPECT_TRUE(torch::allclose(attention(f.context(), x, "b.", nullptr, 0, plain, &rope),
                              plain_linear(f.params, "b.self_attn.o_proj", ye, false), 1e-5, 1e-5));
}

TEST(ModelParts, AttentionIsCausalWithGroupedHeadsAndACache) {
  const auto cfg = small_llama();
  const causal_attention core(cfg.seq_len, torch::kCPU);
  const auto q = torch::randn({2, 4, 5, 4}), k = torch::randn({2, 2, 5, 4}), v = torch::randn({2, 2, 5, 4});
  EXPECT_TRUE(torch::allclose(core(q, k, v, 0), plain_attention(q, k, v, 0), 1e-5, 1e-5));
  // Two new queries after three cached keys.
  EXPECT_TRUE(torch::allclose(core(q.narrow(2, 3, 2), k, v, 3), plain_attention(q.narrow(2, 3, 2), k, v, 3), 1e-5, 1e-5));

  // The part: the separate projections, rotary positions, the core and the output
  // projection, written out; then the same tokens in two calls through a cache.
  const auto& fam = family_of(decoder_arch::llama);
  parts_fixture f(cfg, attention_params(fam, cfg, "b."));
  const rotary_embedding rope(cfg, torch::kCPU);
  const attention_core plain = [&](const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& c,
                                   std::int64_t past) { return core(a, b, c, past); };
  const auto x = torch::randn({2, 5, cfg.d_model});
  const auto got = attention(f.context(), x, "b.", nullptr, 0, plain, &rope);
  auto heads = [](const torch::Tensor& t, std::int64_t n) { return t.view({2, 5, n, 4}).transpose(1, 2); };
  const auto qe = rope.rotate(heads(plain_linear(f.params, "b.self_attn.q_proj", x, false), 4), 0);
  const auto ke = rope.rotate(heads(plain_linear(f.params, "b.self_attn.k_proj", x, false), 2), 0);
  const auto ve = heads(plain_linear(f.params, "b.self_attn.v_proj", x, false), 2);
  const auto ye = plain_attention(qe, ke, ve, 0).transpose(1, 2).reshape({2, 5, 16});
  EXPECT_TRUE(torch::allclose(got, plain_linear(f.params, "b.self_attn.o_proj", ye, false), 1e-5, 1e-5));
  kv_cache cache;
  cache.keys.assign(1, {});
  cache.values.assign(1, {});
  const auto first = attention(f.context(), x.narrow(1, 0, 3), "b.", &cache, 0, plain, &rope);
  cache.length = 3;
  const auto rest = attention(f.context(), x.narrow(1, 3, 2), "b.", &cache, 0, plain, &rope);
  EXPECT_TRUE(torch::allclose(torch::cat({first, rest}, 1), got, 1e-5, 1e-5));

  // GPT-2's fused [q; k; v] with biases, learned positions (none here).
  const auto gcfg = small_gpt();
  const auto& gpt = family_of(decoder_arch::gpt2);
  parts_fixture g(gcfg, attention_params(gpt, gcfg, "h.0."));
  ASSERT_EQ(g.params.m.at("h.0.attn.c_attn.weight").size(0), 3 * gcfg.d_model);
  const auto qkv = plain_linear(g.params, "h.0.attn.c_attn", x, true).split(16, 2);
  const auto y = plain_attention(heads(qkv[0], 4), heads(qkv[1], 4), heads(qkv[2], 4), 0).transpose(1, 2).reshape({2, 5, 16});
  EXPECT_TRUE(torch::allclose(attention(g.context(), x, "h.0.", nullptr, 0, plain, nullptr),
                              plain_linear(g.params, "h.0.attn.c_proj", y, true), 1e-5, 1e-5));
}

TEST(ModelParts, MlpsAreGeluAndSwiglu) {
  const auto x = torch::randn({2, 3, 16});
  const auto gcfg = small_gpt();
  parts_fixture g(gcfg, mlp_params(family_of(decoder_arch::gpt2), gcfg, "h.1."));
  const auto up = plain_linear(g.params, "h.1.mlp.c_fc", x, true);
  const auto gelu = 0.5 * up * (1 + torch::erf(up / std::sqrt(2.0)));
  EXPECT_TRUE(torch::allclose(mlp(g.context(), x, "h.1."), plain_linear(g.params, "h.1.mlp.c_proj", gelu, true), 1e-5, 1e-5));

  const auto lcfg = small_llama();
  parts_fixture l(lcfg, mlp_params(family_of(decoder_arch::llama), lcfg, "b."));
  ASSERT_EQ(l.params.m.size(), 3u);  // gate, up, down; no biases
  const auto gate = plain_linear(l.params, "b.mlp.gate_proj", x, false);
  const auto h = gate * torch::sigmoid(gate) * plain_linear(l.params, "b.mlp.up_proj", x, false);
  EXPECT_TRUE(torch::allclose(mlp(l.context(), x, "b."), plain_linear(l.params, "b.mlp.down_proj", h, false), 1e-5, 1e-5));
}

TEST(ModelParts, ExpertsSumTheirTopChoicesWeightedByTheRouter) {
  auto cfg = small_llama();
  cfg.n_experts = 4;
  cfg.moe_top_k = 2;
  cfg.moe_d_ff = 8;
  cfg.moe_aux_coeff = 0;
  parts_fixture f(cfg, expert_params(family_of(decoder_arch::llama), cfg, "b."));
  ASSERT_EQ(f.params.m.size(), 1u + 4 * 3);
  const expert_parallel none;
  torch::Tensor aux;
  std::map<int, torch::Tensor> tokens;
  expert_tally tally{none, 1.0, aux, tokens};
  const auto x = torch::randn({2, 3, 16});
  torch::NoGradGuard no_grad;
  const auto got = experts(f.context(), x, "b.", 0, tally);
  // Per token: the softmax over the router's logits, the two largest renormalised, and
  // each chosen expert's SwiGLU output times its weight.
  const auto flat = x.reshape({6, 16});
  const auto probs = torch::softmax(plain_linear(f.params, "b.block_sparse_moe.gate", flat, false), -1);
  auto expected = torch::zeros_like(flat);
  for (int n = 0; n < 6; ++n) {
    const auto top = std::get<1>(probs[n].topk(2));
    const double total = probs[n][top[0]].item<double>() + probs[n][top[1]].item<double>();
    for (int c = 0; c < 2; ++c) {
      const int e = top[c].item<int>();
      const std::string p = "b.block_sparse_moe.experts." + std::to_string(e) + ".";
      const auto row = flat.narrow(0, n, 1);
      const auto gate = plain_linear(f.params, p + "w1", row, false);
      const auto out = plain_linear(f.params, p + "w2", gate * torch::sigmoid(gate) * plain_linear(f.params, p + "w3", row, false), false);
      expected.narrow(0, n, 1).add_(out * (probs[n][e].item<double>() / total));
    }
  }
  EXPECT_TRUE(torch::allclose(got.reshape({6, 16}), expected, 1e-5, 1e-5));
}

TEST(ModelParts, AFamilyIsATableAndANewTableComposesTheSameParts) {
  // The two families' blocks carry Hugging Face's names, in its order.
  EXPECT_EQ(names(block_params(family_of(decoder_arch::gpt2), small_gpt(), 1)),
            (std::vector<std::string>{"h.1.ln_1.weight", "h.1.ln_1.bias", "h.1.attn.c_attn.weight",
                                      "h.1.attn.c_attn.bias", "h.1.attn.c_proj.weight", "h.1.attn.c_proj.bias",
                                      "h.1.ln_2.weight", "h.1.ln_2.bias", "h.1.mlp.c_fc.weight", "h.1.mlp.c_fc.bias",
                                      "h.1.mlp.c_proj.weight", "h.1.mlp.c_proj.bias"}));
  EXPECT_EQ(names(block_params(family_of(decoder_arch::llama), small_llama(), 0)),
            (std::vector<std::string>{"model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_proj.weight",
                                      "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight",
                                      "model.layers.0.self_attn.o_proj.weight",
                                      "model.layers.0.post_attention_layernorm.weight",
                                      "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
                                      "model.layers.0.mlp.down_proj.weight"}));

  // A new family from the same parts: llama's blocks with LayerNorms, biases on every
  // projection and GELU MLPs, under names of its own. Only the table is new.
  decoder_family mixed = family_of(decoder_arch::llama);
  mixed.norm = norm_kind::layer_norm;
  mixed.attention.qkv_bias = mixed.attention.out_bias = true;
  mixed.mlp = {mlp_kind::gelu, true, "ffn.", "fc_in", "", "fc_out"};
  mixed.block_prefix = "layers.";
  mixed.attention_norm = "norm_1";
  mixed.mlp_norm = "norm_2";
  const auto cfg = small_llama();
  const auto table = block_params(mixed, cfg, 0);
  EXPECT_EQ(table.size(), 2u + 8 + 2 + 4);
  EXPECT_EQ(table[2].name, "layers.0.self_attn.q_proj.weight");
  EXPECT_EQ(table[3].name, "layers.0.self_attn.q_proj.bias");
  param_map params(table, 3);
  const tensor_parallel tp;
  const part_context c{mixed, cfg, params, nullptr, tp, false, block_pass::plain, cfg.n_head, cfg.kv_heads()};
  const causal_attention core(cfg.seq_len, torch::kCPU);
  const attention_core plain = [&](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                   std::int64_t past) { return core(q, k, v, past); };
  const rotary_embedding rope(cfg, torch::kCPU);
  const expert_parallel none;
  torch::Tensor aux;
  std::map<int, torch::Tensor> tokens;
  expert_tally tally{none, 1.0, aux, tokens};
  const auto x = torch::randn({2, 5, cfg.d_model});
  const auto y = decoder_block(c, x, 0, nullptr, 0, {plain, &rope, tally});
  // The block is its parts composed: h = x + attention(norm_1(x)), h + mlp(norm_2(h)).
  const auto h = x + attention(c, norm(c, x, "layers.0.norm_1"), "layers.0.", nullptr, 0, plain, &rope);
  EXPECT_TRUE(torch::allclose(y, h + mlp(c, norm(c, h, "layers.0.norm_2"), "layers.0."), 1e-6, 1e-6));
  EXPECT_THROW(params.param("layers.0.mlp.gate_proj.weight"), model_error);
}

}  // namespace troupe
