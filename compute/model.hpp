#pragma once
// The two reference models of WORKLOADS.md, buildable as slices of their layers.
//
// A slice owns a contiguous range of layers. Its parameters live in one flat buffer (each
// parameter is a view into it; fp32, or bf16 for bf16 stages) and their gradients in
// another flat fp32 buffer of the same layout (each `.grad()` is a view), so optimizer
// shards and collectives can work on contiguous ranges that ignore parameter boundaries
// (Megatron's distributed optimizer).
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <torch/types.h>

#include "compute/collective_group.hpp"
#include "compute/partition.hpp"

namespace troupe {

struct model_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// A decoder's architecture: GPT-2's (WORKLOADS.md "gpt-tiny": learned positions,
/// LayerNorm with biases, fused qkv, GELU MLP) or Llama's ("llama-tiny": rotary
/// positions, RMSNorm, grouped-query attention, SwiGLU MLP, no biases; Hugging Face names).
enum class decoder_arch { gpt2, llama };

/// A decoder's shape (Megatron's TransformerConfig, for the two architectures).
struct decoder_config {
  int n_layer = 8;
  int n_head = 4;
  int d_model = 128;
  int d_ff = 512;
  int seq_len = 128;
  int vocab = 256;              ///< rows of the token embedding (and of the output layer)
  decoder_arch arch = decoder_arch::gpt2;
  int n_kv_head = 0;            ///< llama: key/value heads (grouped-query attention); 0: n_head
  double rope_theta = 10000;    ///< llama: the rotary embedding's base
  double norm_eps = 1e-5;       ///< LayerNorm's / RMSNorm's epsilon
  bool tie_embeddings = true;   ///< the output layer is the token embedding (no lm_head)
  int vocab_used = 0;           ///< a tokenizer's pieces, below vocab: the padded rows' logits are
                                ///< left out of the softmax (as minus infinity); 0: every row is used
  // Mixture of experts (WORKLOADS.md "moe-tiny"; llama): Mixtral's sparse MLP in place of
  // the MLP of every moe_every-th block (blocks 0, moe_every, 2 moe_every, ...).
  int n_experts = 0;            ///< 0: dense
  int moe_top_k = 2;            ///< experts per token
  int moe_d_ff = 0;             ///< each expert's width (0: d_ff)
  double moe_aux_coeff = 0.01;  ///< the load-balancing loss's coefficient
  int moe_every = 1;
  /// Training drops the (token, choice) pairs past each expert's capacity in a sequence,
  /// expert_capacity(seq_len) (Megatron's moe_expert_capacity_factor, per sequence); 0: none.
  double moe_capacity_factor = 0;

  int head_dim() const { return d_model / n_head; }
  int kv_heads() const { return n_kv_head > 0 ? n_kv_head : n_head; }
  bool is_moe_block(int i) const { return n_experts > 0 && i % moe_every == 0; }
  int expert_d_ff() const { return moe_d_ff > 0 ? moe_d_ff : d_ff; }
  /// The (token, choice) pairs an expert takes of a sequence of `tokens` in training:
  /// ceil(factor x tokens x top_k / experts) (Megatron's get_capacity); 0: no limit.
  std::int64_t expert_capacity(std::int64_t tokens) const {
    if (moe_capacity_factor <= 0 || n_experts == 0) return 0;
    return std::int64_t(std::ceil(moe_capacity_factor * double(tokens * moe_top_k) / double(n_experts)));
  }
};

/// Which model and its shape.
struct model_spec {
  enum class kind { decoder, mlp };
  kind type = kind::decoder;
  decoder_config decoder;
  std::vector<int> mlp_widths{784, 512, 512, 256, 10};  ///< fmnist-mlp

  static model_spec gpt_tiny() { return {}; }
  /// GPT-2 124M's shape (12 layers, 12 heads, d_model 768, seq 1024) on 256 byte values.
  static model_spec gpt_small() {
    model_spec s;
    s.decoder = {12, 12, 768, 3072, 1024, 256};
    return s;
  }
  /// WORKLOADS.md "llama-tiny": 8 layers, 4 heads, 2 key/value heads, d_model 128, d_ff 384.
  static model_spec llama_tiny() {
    model_spec s;
    s.decoder = {8, 4, 128, 384, 128, 256, decoder_arch::llama, 2, 10000, 1e-5, false};
    return s;
  }
  /// For GPUs: 12 layers, d_model 768, 12 heads, 4 key/value heads, d_ff 2048, seq 1024.
  static model_spec llama_small() {
    model_spec s;
    s.decoder = {12, 12, 768, 2048, 1024, 256, decoder_arch::llama, 4, 10000, 1e-5, false};
    return s;
  }
  /// WORKLOADS.md "moe-tiny": llama-tiny whose every MLP is 4 SwiGLU experts of d_ff 192, top-2.
  static model_spec moe_tiny() {
    model_spec s = llama_tiny();
    s.decoder.n_experts = 4;
    s.decoder.moe_d_ff = 192;
    return s;
  }
  /// For GPUs: llama-small with 8 experts (each of llama-small's d_ff), top-2.
  static model_spec moe_small() {
    model_spec s = llama_small();
    s.decoder.n_experts = 8;
    return s;
  }
  static model_spec fmnist_mlp() {
    model_spec s;
    s.type = kind::mlp;
    return s;
  }
  bool is_llama() const { return type == kind::decoder && decoder.arch == decoder_arch::llama; }
  /// Number of sliceable layers (transformer blocks or Linear layers).
  int n_layers() const { return type == kind::decoder ? decoder.n_layer : int(mlp_widths.size()) - 1; }
  std::string name() const { return type == kind::mlp ? "fmnist-mlp" : is_llama() ? "llama" : "gpt"; }
};

/// "gpt2" or "llama"; throws std::invalid_argument otherwise.
decoder_arch parse_decoder_arch(const std::string& name);
const char* decoder_arch_name(decoder_arch arch);

/// The parameter that the first and the last pipeline stage each hold a copy of (the
/// token embedding, tied to the output layer): "wte.weight" (gpt2),
/// "model.embed_tokens.weight" (llama); "" for untied decoders and the MLP.
std::string tied_parameter(const model_spec& spec);

/// Activation recomputation (see model_slice::set_recompute).
enum class recompute_mode { none, selective, full };
/// "none", "selective" or "full"; throws std::invalid_argument otherwise.
recompute_mode parse_recompute(const std::string& name);

/// An ordered `state_dict`: parameter name -> tensor, in the model's canonical order.
using state_dict = std::vector<std::pair<std::string, torch::Tensor>>;

/// The full model's initial parameters for `seed` (WORKLOADS.md init), canonical order.
state_dict initial_state(const model_spec& spec, std::uint64_t seed);

/// The full model's parameter names in canonical (state_dict) order.
std::vector<std::string> parameter_names(const model_spec& spec);

/// The parameters of the slice for `range` (make_slice), in its order; a last slice of
/// a tied decoder without the embeddings names tied_parameter(spec), its copy of the
/// tied output layer.
std::vector<std::string> slice_parameter_names(const model_spec& spec, const layer_range& range);

/// The expert an expert parameter belongs to ("model.layers.1.block_sparse_moe.experts.3.w1.weight":
/// 3); -1 for every other parameter (the router included).
int expert_of(const std::string& name);

/// The experts a slice holds under expert parallelism (Megatron's expert-data-parallel
/// layout): rank `rank` of `size` holds experts [rank E/size, (rank + 1) E/size) of each
/// expert layer and no other. They come after the dense parameters, in a region of the
/// flat buffers of their own (model_slice::expert_offset), padded to a multiple of
/// `pad_to`: the expert-data-parallel group (the ranks holding the same experts) shards
/// that region, as the data-parallel group shards the dense one. Inactive (size 1): the
/// slice holds every expert, in the model's order, and has no expert region.
struct expert_share {
  int rank = 0;
  int size = 1;
  std::int64_t pad_to = 1;
  bool active() const { return size > 1; }
  /// Whether this rank holds parameter `name` (every parameter but other ranks' experts).
  bool holds(const std::string& name, int n_experts) const;
};

/// The full model's number of parameters (the tied output layer counted once).
std::int64_t parameter_count(const model_spec& spec);

/// Checks that `state` holds exactly the full model's parameters with the right shapes;
/// throws model_error naming every missing, unexpected or mis-shaped entry.
void check_state(const model_spec& spec, const state_dict& state);

/// How a parameter is split over a tensor-parallel group (compute/tensor_parallel.hpp).
enum class tp_split {
  replicated,  ///< every rank holds all of it (norms, row-parallel biases, positions)
  rows,        ///< dim 0 (column-parallel weights and their biases, vocab-parallel rows)
  columns,     ///< dim 1 (row-parallel weights)
  qkv_rows,    ///< gpt2's c_attn: dim 0 as three blocks [q; k; v], each split in rows
};

/// One parameter's place in a slice's flat buffers.
/// Tokens routed to each expert, per expert layer: block index -> one count per expert,
/// then the (token, choice) pairs dropped past the experts' capacity.
using expert_counts = std::map<int, std::vector<std::int64_t>>;
/// Adds `from`'s counts into `into`.
void add_expert_counts(expert_counts& into, const expert_counts& from);

struct param_entry {
  std::string name;              ///< global name, e.g. "h.3.attn.c_attn.weight"
  std::vector<std::int64_t> shape;
  std::int64_t offset = 0;       ///< first element in the flat buffers
  std::int64_t numel = 0;
  bool decay = false;            ///< weight decay applies (2-D weights, not gpt2's wpe)
  tp_split split = tp_split::replicated;  ///< how tensor parallelism splits it
  bool shared_copy = false;      ///< a second copy of a tied parameter (last stage's embedding),
                                 ///< or of a parameter every tensor-parallel rank holds whole
                                 ///< (on ranks other than 0): it is not counted twice in the
                                 ///< grad norm nor saved twice
};

/// The keys and values a decoder slice's attention has computed for the tokens it has seen
/// (generation: each new token attends to them instead of running the earlier ones again).
/// Each block's keys and values live in a buffer of the model's whole context, allocated
/// by the first call: later tokens are written after the earlier ones, nothing is copied.
struct kv_cache {
  std::vector<torch::Tensor> keys, values;  ///< per block of the slice: (batch, heads, seq_len, head dim),
                                            ///< positions 0 .. length - 1 filled
  std::int64_t length = 0;                  ///< tokens seen (the next token's position)
  void clear() { *this = kv_cache{}; }
};

/// Weight gradients a split backward left for later (the zero-bubble schedules' W op):
/// per linear layer, the weight, the layer's input and its output's gradient (in the
/// precision the layer computed in).
class weight_grad_store {
 public:
  /// Adds grad_output^T input (over all leading dimensions) to each weight's gradient,
  /// in fp32 like the autograd's accumulation, and forgets them.
  void apply();
  bool empty() const { return items_.empty(); }
  std::size_t size() const { return items_.size(); }
  void clear() { items_.clear(); }
  /// A deferring layer's backward.
  void add(torch::Tensor weight, torch::Tensor input, torch::Tensor grad_output);

 private:
  struct item {
    torch::Tensor weight, input, grad_output;
  };
  std::vector<item> items_;
};

/// A contiguous slice of a model's layers with flat parameter and gradient buffers.
///
/// Parameter precision: a slice made with fp32 parameters (the default) computes with them
/// as they are. A slice made with bf16 parameters (bf16 stages, as in Megatron's bf16
/// models: 2 bytes per parameter) holds its flat parameter buffer in bf16: the weights and
/// biases of matrix products are views into it, which autocast uses without a cast (no
/// per-micro-batch bf16 copy kept for the backward); the layer norms and embeddings, which
/// compute in fp32, are fp32 tensors holding the buffer's values (`set_params` refreshes
/// them). Gradients are fp32 either way: each parameter's `.grad()` is an fp32 view of the
/// gradient buffer, and the autograd adds each micro-batch's bf16 gradient into it in fp32
/// (Megatron's fp32 main_grad). Under bf16 autocast such a slice computes exactly what an
/// fp32-parameter slice holding the same bf16 values computes, gradients included.

class model_slice {
 public:
  virtual ~model_slice() = default;

  /// First slice: `input` is data (token ids, or images); otherwise the previous
  /// slice's activation. Last slice: returns the final features (see `loss`).
  virtual torch::Tensor forward(const torch::Tensor& input) = 0;
  /// Last slice only: mean loss of `output` (from forward) against `target`.
  virtual torch::Tensor loss(const torch::Tensor& output, const torch::Tensor& target) = 0;
  /// Last slice only: logits from `output` (for accuracy).
  virtual torch::Tensor logits(const torch::Tensor& output) = 0;
  /// Decoder slices, for inference (no graph): `input` holds the tokens (or the previous
  /// slice's activations) that follow the `cache.length` tokens `cache` has seen, at
  /// positions cache.length, cache.length + 1, ...; they attend to the cached keys and
  /// values and to each other (causally), and theirs are appended. The result equals the
  /// matching rows of `forward` over all the tokens. Throws model_error past the model's
  /// context (seq_len positions) and for models without attention.
  virtual torch::Tensor forward_cached(const torch::Tensor& input, kv_cache& cache);

  const layer_range& range() const { return range_; }
  bool is_first() const { return range_.first_slice; }
  bool is_last() const { return range_.last_slice; }

  const std::vector<param_entry>& entries() const { return entries_; }
  /// Parameter views, in entry order.
  const std::vector<torch::Tensor>& parameters() const { return params_; }
  torch::Tensor& param(const std::string& name);
  /// Flat buffers; their length is the entries' total rounded up to `pad_to`. The
  /// parameters' buffer is in the slice's parameter dtype, the gradients' in fp32.
  torch::Tensor flat_params() const { return flat_params_; }
  /// Sets every parameter from `src`, a flat buffer of the same length (any dtype and
  /// device; rounded to the parameter dtype), fp32 copies included. Writing into
  /// `flat_params()` directly leaves a bf16 slice's fp32 copies stale.
  void set_params(const torch::Tensor& src);
  torch::Tensor flat_grads() const { return flat_grads_; }
  std::int64_t numel() const { return numel_; }  ///< without padding
  /// Where the expert region of the flat buffers begins (a slice made with an active
  /// expert_share): [0, expert_offset()) holds the dense parameters, padded; the rest this
  /// rank's experts, padded. Without an expert region: the buffers' length.
  std::int64_t expert_offset() const { return expert_offset_; }
  void zero_grads() { flat_grads_.zero_(); }

  /// This slice's parameters (shared copies left out) as a state_dict (fp32 CPU copies).
  state_dict state(bool include_shared_copies = false) const;

  /// Activation recomputation. full (Megatron's full recompute, one layer per
  /// checkpoint): a forward that builds a graph keeps only the input of each transformer
  /// block and runs the block again during the backward (under the same precision), so a
  /// micro-batch waiting for its backward holds one activation per block instead of all
  /// of them. selective (Megatron's selective recompute): only the attention core
  /// (softmax(q k^T / sqrt(d)) v) keeps just q, k and v and runs again in the backward:
  /// no T x T scores or probabilities held, for little compute. Gradients are
  /// bit-identical to those without it. Decoder slices only (the MLP has no blocks: it
  /// ignores the setting, which the job config refuses for it).
  void set_recompute(recompute_mode mode) { recompute_ = mode; }
  void set_recompute(bool full) { recompute_ = full ? recompute_mode::full : recompute_mode::none; }
  recompute_mode recompute() const { return recompute_; }
  /// The residual stream's dtype in decoder slices (the MLP has none): fp32 (the
  /// default) keeps what autocast gives, an fp32 stream between and through the blocks
  /// whose layer norms compute in fp32. bf16 (Megatron's default for bf16 models, the
  /// opposite of its --fp32-residual-connection) rounds the stream to bf16 where a slice
  /// starts (after the embeddings, or the input it gets) and keeps it there: the
  /// residual adds, the layer norms' input and output (their statistics still in fp32,
  /// inside the kernel; their weights used as bf16 values, as in a bf16 model) and the
  /// output are bf16, so no cast kernel surrounds each layer norm and the element-wise
  /// kernels move half the bytes. Under bf16 autocast only; an fp32 forward ignores it.
  void set_residual_dtype(torch::ScalarType dtype) { residual_ = dtype; }
  /// Blocks (full) and attention cores (selective) run again in backwards so far, by every
  /// slice of this process (tests check that a runtime recomputes what it should).
  static std::int64_t blocks_recomputed();
  static std::int64_t attentions_recomputed();

  /// Split backward (zero-bubble schedules): while a store is set, a forward that builds
  /// a graph defers its linear layers' weight gradients (the transformer blocks' four, the
  /// MLP's layers; as ZB-H1 does, the cheap rest stays in the backward). Its backward then
  /// computes the input's gradient and every other parameter's, and leaves in `store`
  /// what `store->apply()` needs for the deferred ones; together they give the plain
  /// backward's gradients. The store must outlive that backward. nullptr: plain backward.
  void defer_weight_grads(weight_grad_store* store) { defer_ = store; }

  /// Mixture of experts: each forward that builds a graph adds its blocks' load-balancing
  /// loss (the mean over its sequences) to the loss it back-propagates, times `scale`, the
  /// weight its micro-batch's loss gets (micro-batch size / global batch), as Megatron's
  /// MoEAuxLossAutoScaler does: the gradient enters at the block's output.
  void set_aux_loss_scale(double scale) { aux_scale_ = scale; }
  /// Expert parallelism: this slice computes only rank `ep.rank`'s experts (E/EP of each
  /// expert layer), for the tokens of every rank of the group, whose other members run
  /// the same forwards and backwards in the same order (compute/expert_parallel.hpp). Made
  /// with the matching expert_share, the slice holds only those experts; without one it
  /// holds every expert, and the other ranks' get no gradient here.
  void set_expert_parallel(expert_parallel ep) { ep_ = std::move(ep); }
  /// The load-balancing loss those forwards added, times the scale (summed over blocks and
  /// forwards), and zeroes it: after a step's forwards, the step's auxiliary loss (for
  /// the log; 0 without experts).
  double take_aux_loss();
  /// Experts: the (token, choice) pairs each expert got in those forwards, per expert layer
  /// (block index -> one count per expert, then the pairs dropped past the experts'
  /// capacity; a rank's own tokens under expert parallelism), and zeroes them.
  expert_counts take_expert_tokens();

 protected:
  /// x w^T + b, its weight gradient left to `defer_` when that is set and a graph is built.
  torch::Tensor linear_layer(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b);
  weight_grad_store* defer_ = nullptr;
  double aux_scale_ = 1.0;
  expert_parallel ep_;
  torch::Tensor aux_sum_;  ///< take_aux_loss's, undefined when nothing was added
  std::map<int, torch::Tensor> expert_tokens_;  ///< take_expert_tokens's, on the slice's device

  /// Lays out `names` (taken from `state`) into the flat buffers; with an active `experts`,
  /// only that rank's experts, in a region of their own after the dense parameters.
  void allocate(const model_spec& spec, const state_dict& state, std::vector<std::string> names,
                const std::vector<std::string>& shared_copies, std::int64_t pad_to, torch::Device device,
                torch::ScalarType param_dtype, const expert_share& experts);
  layer_range range_;
  recompute_mode recompute_ = recompute_mode::none;
  torch::ScalarType residual_ = torch::kFloat32;

 private:
  std::vector<param_entry> entries_;
  std::vector<torch::Tensor> params_;
  std::map<std::string, std::size_t> index_;
  torch::Tensor flat_params_, flat_grads_;
  std::vector<std::size_t> fp32_copies_;  ///< entries whose parameter is an fp32 copy (bf16 slices)
  std::int64_t numel_ = 0;
  std::int64_t expert_offset_ = 0;
};

/// Builds the slice for `range`, taking its parameters from a full-model `state`.
/// `pad_to`: flat buffers are padded to a multiple of this (the data-parallel width);
/// `device`: where the buffers (and the computation) live; `param_dtype`: fp32, or bf16
/// (the parameters are `state`'s rounded to bf16; see model_slice). `tp`: the slice's
/// rank in a tensor-parallel group (decoders): it holds that rank's part of each parameter
/// (compute/tensor_parallel.hpp; the names stay the whole model's), and its forward and
/// backward run the group's collectives (a `tp` without a group: a slice that only lays
/// out the rank's part, for optimizer shards). The parameters every rank holds whole are
/// shared copies on ranks other than 0 (counted once in the grad norm, saved once).
/// `experts`: the experts the slice holds (expert_share; the experts are whole on every
/// tensor-parallel rank and no shared copies: each expert-data-parallel group holds its own).
std::unique_ptr<model_slice> make_slice(const model_spec& spec, const layer_range& range,
                                        const state_dict& state, std::int64_t pad_to = 1,
                                        torch::Device device = torch::kCPU,
                                        torch::ScalarType param_dtype = torch::kFloat32,
                                        const tensor_parallel& tp = {}, const expert_share& experts = {});

}  // namespace troupe
