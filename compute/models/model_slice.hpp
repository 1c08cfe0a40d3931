#pragma once
// A contiguous slice of a model's layers with flat parameter and gradient buffers: what a
// pipeline stage holds. The two models of WORKLOADS.md are slices of this kind: decoders
// (compute/models/decoder_slice.hpp: parts composed as their family says) and the MLP.
//
// A slice owns a contiguous range of layers. Its parameters live in one flat buffer (each
// parameter is a view into it; fp32, or bf16 for bf16 stages) and their gradients in
// another flat fp32 buffer of the same layout (each `.grad()` is a view), so optimizer
// shards and collectives can work on contiguous ranges that ignore parameter boundaries
// (Megatron's distributed optimizer).
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/types.h>

#include "compute/models/kv_cache.hpp"
#include "compute/models/model_spec.hpp"
#include "compute/models/parameters.hpp"
#include "compute/models/split_backward.hpp"
#include "compute/parallel/collective_group.hpp"
#include "compute/parallel/context_parallel.hpp"

namespace troupe {

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

class model_slice : public named_parameters {
 public:

  /// First slice: `input` is data (token ids, or images); otherwise the previous
  /// slice's activation. Last slice: returns the final features (see `loss`).
  /// `positions` (decoders, --document-attention): the documents of the window, as the
  /// position of each token (B, T) int64 (document_positions: 0 where a document begins);
  /// a token attends to the earlier tokens of its own document only. Undefined: one
  /// causal sequence at positions 0, 1, ... Every slice of a forward gets the same.
  virtual torch::Tensor forward(const torch::Tensor& input, const torch::Tensor& positions = {}) = 0;
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
  torch::Tensor& param(const std::string& name) override;
  /// Flat buffers; their length is the entries' total rounded up to `pad_to` (each
  /// block begun at a multiple of it: entry_block). The parameters' buffer is in the
  /// slice's parameter dtype, the gradients' in fp32. After split_buffers they no longer
  /// hold the parameters (their layout and length stay; use set_params, not these).
  torch::Tensor flat_params() const { return flat_params_; }
  /// Sets every parameter from `src`, a flat buffer of the same length (any dtype and
  /// device; rounded to the parameter dtype), fp32 copies included. Writing into
  /// `flat_params()` directly leaves a bf16 slice's fp32 copies stale.
  void set_params(const torch::Tensor& src);
  /// After writing into the parameters' buffer directly (`flat_params()`, or a unit's
  /// after split_buffers): a bf16 slice's fp32 copies take its values (fp32 slices have
  /// none).
  void refresh_copies();
  torch::Tensor flat_grads() const { return flat_grads_; }
  std::int64_t numel() const { return numel_; }  ///< without padding
  /// Where the expert region of the flat buffers begins (a slice made with an active
  /// expert_share): [0, expert_offset()) holds the dense parameters, padded; the rest this
  /// rank's experts, padded. Without an expert region: the buffers' length.
  std::int64_t expert_offset() const { return expert_offset_; }
  void zero_grads() { flat_grads_.zero_(); }  ///< (not after split_buffers: the units' buffers hold them)

  /// The block (transformer layer) entry `i` belongs to; -1 for the embeddings, the final
  /// norm and the output layer (and every parameter of a model without blocks). A
  /// decoder's blocks begin at a multiple of the padding in their region of the flat
  /// buffers (the dense one, or the expert one), so a block's elements can be cut into
  /// gradient buckets of their own: a unit of fully sharded data parallelism.
  int entry_block(std::size_t i) const { return entry_blocks_.at(i); }
  /// A unit's buffers (split_buffers).
  struct unit_buffers {
    torch::Tensor params, grads;
  };
  /// Fully sharded data parallelism by blocks (compute/optim/fsdp.hpp): gives each of
  /// `units` (disjoint sets of [begin, end) ranges of the flat buffers, each holding whole
  /// parameters) a parameter buffer and a gradient buffer of its own, its ranges one after
  /// another, holding the values the flat buffers hold; every parameter (and its
  /// `.grad()`) of a unit becomes a view of them. Every parameter must be in a unit. The
  /// flat buffers' storage is left to the caller (it holds what it held, no longer the
  /// parameters'); `set_params` and `refresh_copies` then use the units' buffers.
  std::vector<unit_buffers> split_buffers(const std::vector<std::vector<std::pair<std::int64_t, std::int64_t>>>& units);
  /// refresh_copies for the entries within [begin, end) only.
  void refresh_copies(std::int64_t begin, std::int64_t end);

  /// Called around each block's forward and backward (fully sharded data parallelism by
  /// blocks: a block's parameters gathered before and released after).
  class block_hooks {
   public:
    virtual ~block_hooks() = default;
    /// Block `block` is about to run: its forward, or (`backward`) its backward, once the
    /// gradient of its output is complete (a forward that builds a graph registers it).
    virtual void before(int block, bool backward) = 0;
    /// Block `block` ran: its forward, or (`backward`) its backward, once the gradient of
    /// its input is complete (its parameters' gradients are in).
    virtual void after(int block, bool backward) = 0;
  };
  /// The hooks the forwards from now on call and register (null: none). A registered
  /// backward hook calls the hooks its forward had: they must outlive its graph.
  void set_block_hooks(block_hooks* hooks) { hooks_ = hooks; }

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
  /// the same forwards and backwards in the same order (compute/parallel/expert_parallel.hpp). Made
  /// with the matching expert_share, the slice holds only those experts; without one it
  /// holds every expert, and the other ranks' get no gradient here.
  void set_expert_parallel(expert_parallel ep) { ep_ = std::move(ep); }
  /// Context parallelism: this slice computes rank `cp.rank`'s tokens of every sequence
  /// (chunks rank and 2 size - 1 - rank: compute/parallel/context_parallel.hpp). A first
  /// slice takes them from whole sequences of tokens, a loss from whole targets; between
  /// slices the activations hold those tokens only. Decoders only (model_error otherwise).
  virtual void set_context_parallel(context_parallel cp);
  const context_parallel& cp_place() const { return cp_; }
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
  context_parallel cp_;
  torch::Tensor aux_sum_;  ///< take_aux_loss's, undefined when nothing was added
  std::map<int, torch::Tensor> expert_tokens_;  ///< take_expert_tokens's, on the slice's device

  /// Lays out `names` (taken from `state`) into the flat buffers; with an active `experts`,
  /// only that rank's experts, in a region of their own after the dense parameters;
  /// `rows`: the parameter table whose splits the entries record (its tensor-parallel
  /// group's: rows_by_name(spec, size); nullptr: rows_by_name(spec)). `block_prefix`
  /// (decoders: "h.", "model.layers."): the entries' blocks are read from their names, and
  /// each block begins at a multiple of the padding within its region.
  void allocate(const model_spec& spec, const state_dict& state, std::vector<std::string> names,
                const std::vector<std::string>& shared_copies, std::int64_t pad_to, torch::Device device,
                torch::ScalarType param_dtype, const expert_share& experts,
                const std::map<std::string, param_spec>* rows = nullptr, const std::string& block_prefix = {});
  layer_range range_;
  block_hooks* hooks_ = nullptr;
  recompute_mode recompute_ = recompute_mode::none;
  torch::ScalarType residual_ = torch::kFloat32;

 private:
  std::vector<param_entry> entries_;
  std::vector<torch::Tensor> params_;
  std::vector<torch::Tensor> sources_;  ///< each entry's view of the buffer (a bf16 slice's copies': their source)
  std::vector<int> entry_blocks_;
  /// split_buffers's units: each range of the flat buffers and the view of a unit's buffer
  /// holding it (none: the flat buffer holds the parameters).
  std::vector<std::pair<std::pair<std::int64_t, std::int64_t>, torch::Tensor>> segments_;
  std::map<std::string, std::size_t> index_;
  torch::Tensor flat_params_, flat_grads_;
  std::vector<std::size_t> fp32_copies_;  ///< entries whose parameter is an fp32 copy (bf16 slices)
  std::int64_t numel_ = 0;
  std::int64_t expert_offset_ = 0;
};


}  // namespace troupe
