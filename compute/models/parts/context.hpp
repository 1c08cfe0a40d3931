#pragma once
// What the parts of a decoder block compute with: the family's table, the shape, the
// slice's parameters by name, the split backward's store, and the slice's place in a
// tensor-parallel group. Tensor and sequence parallelism enter the parts only here, as
// column- and row-parallel projections over compute/parallel/'s collectives.
#include <cstdint>
#include <string>

#include <torch/types.h>

#include "compute/models/family.hpp"
#include "compute/models/model_spec.hpp"
#include "compute/models/parameter.hpp"
#include "compute/models/split_backward.hpp"
#include "compute/parallel/collective_group.hpp"
#include "compute/parallel/context_parallel.hpp"

namespace troupe {

/// How a block runs.
enum class block_pass {
  plain,          ///< a forward: with a graph (training) or without (inference)
  checkpointing,  ///< a full recompute's forward: no graph, but a training forward
  recomputing,    ///< a full recompute's rerun in the backward, with a graph
};

/// The group of a tensor-parallel rank; throws model_error for a rank that computes
/// without one (an optimizer shard's layout).
collective_group& group_of(const tensor_parallel& tp);

struct part_context {
  const decoder_family& family;
  const decoder_config& cfg;
  named_parameters& params;
  weight_grad_store* defer = nullptr;  ///< the split backward's store (nullptr: plain backward)
  const tensor_parallel& tp;
  /// Sequence parallelism in this pass (not in generation): the activations between the
  /// parts hold this rank's positions only.
  bool sequence = false;
  block_pass pass = block_pass::plain;
  std::int64_t heads = 0, kv_heads = 0;  ///< this rank's query and key/value heads
  /// Context parallelism (null or inactive: none): this rank holds 1/size of every
  /// sequence's tokens; what sums over whole sequences (the experts' load-balancing
  /// loss) sums over the group.
  const context_parallel* cp = nullptr;

  torch::Tensor& param(const std::string& name) const { return params.param(name); }
  /// The layer `name` ("h.0.attn.c_attn"): x w^T, plus its bias when `bias`.
  torch::Tensor linear(const torch::Tensor& x, const std::string& name, bool bias) const;
  /// Entering a column-parallel layer: f, or with sequence parallelism the gather of the
  /// sequence (x itself without tensor parallelism).
  torch::Tensor enter(const torch::Tensor& x) const;
  /// A row-parallel layer: its bias (when `bias`) added after the sum over the group (g,
  /// or with sequence parallelism the reduce-scatter of the sequence).
  torch::Tensor row_parallel(const torch::Tensor& x, const std::string& name, bool bias) const;
  /// Sequence parallelism of the slice (in any pass).
  bool slice_sequence() const { return tp.active() && tp.sequence; }
  collective_group& group() const;  ///< group_of(tp)
};

}  // namespace troupe
