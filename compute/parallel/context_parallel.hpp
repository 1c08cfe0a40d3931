#pragma once
// Context parallelism (Megatron-Core's --context-parallel-size): each sequence of S tokens
// is split over the C ranks of a context-parallel group. With causal attention the later
// tokens attend to more keys, so the sequence is cut into 2C chunks of S / 2C and rank i
// holds chunks i and 2C-1-i (Megatron's load balancing): every rank then computes the same
// share of the attention. Everything but the attention's core works on the local tokens
// alone (norms, the MLP, the embedding and the loss; rotary and learned positions at the
// tokens' global positions). The core needs every earlier key, by one of:
//
// - p2p (ring attention): the key/value blocks pass around the ring, C - 1 shifts, each
//   overlapped with the attention of the block in hand; the blocks' partial results are
//   merged by their log-sum-exp (the online softmax). The backward passes the blocks
//   around again; their key/value gradients follow them a shift behind, summed on the
//   way, and end at their owner (each shift overlapped with a block's compute but the
//   last).
// - a2a (DeepSpeed-Ulysses): an all-to-all trades sequence for heads, so that each rank
//   attends over the whole sequence with H / C of the heads, and a second one trades back.
// - allgather: every rank gathers every rank's keys and values (the backward
//   reduce-scatters their gradients).
//
// Grouped-query attention sends the key/value heads only. The cores save their inputs,
// the output and the log-sum-exp, and recompute the scores in the backward, block by
// block (flash attention's memory: no S x S scores are kept).
#include <cstdint>
#include <memory>
#include <string>

#include <torch/types.h>

#include "compute/parallel/collective_group.hpp"

namespace troupe {

enum class cp_comm { p2p, a2a, allgather };
/// "p2p", "a2a", "allgather"; anything else throws std::invalid_argument.
cp_comm parse_cp_comm(const std::string& name);
const char* cp_comm_name(cp_comm c);

/// A model slice's place in its context-parallel group (size 1: whole sequences).
struct context_parallel {
  int rank = 0;
  int size = 1;
  cp_comm comm = cp_comm::p2p;
  std::shared_ptr<collective_group> group;  ///< size > 1: the group's member of this rank
  /// p2p: each shift started before the compute it runs beside and waited for after it.
  /// False (benchmarks: what the overlap hides): waited for as soon as it is started.
  bool overlap = true;
  bool active() const { return size > 1; }
};

namespace cp {

/// The global positions of rank `rank`'s tokens of a sequence of `seq_len` over `size`
/// ranks, in their local order: chunk `rank`, then chunk 2 size - 1 - rank ((2 c) int64,
/// c = seq_len / (2 size)).
torch::Tensor local_positions(std::int64_t seq_len, int size, int rank, torch::Device device = torch::kCPU);
/// Every rank's positions, in rank order: the global position of each token of an
/// exchange that holds every rank's tokens, rank after rank.
torch::Tensor all_positions(std::int64_t seq_len, int size, torch::Device device = torch::kCPU);
/// Rank `rank`'s tokens of `x` along `dim` (whole sequences there), in that order.
torch::Tensor local_tokens(const torch::Tensor& x, std::int64_t dim, int size, int rank);

/// The causal core over the group: q (B, H, L, hd), k and v (B, KV, L, hd) of this rank's
/// L = seq_len / size tokens (local_tokens' order); query head h uses key/value head
/// h / (H / KV). With a `window` > 0 (a sliding window) the query at position i sees the
/// keys at positions i - window + 1 .. i only. With `documents` ((B, seq_len) int64: each
/// token's document number in its whole sequence, global order; document_numbers) a query
/// sees only the keys of its own document (Megatron's reset attention mask). Returns
/// (B, H, L, hd) in q's dtype (the arithmetic in fp32). Every rank of the group calls it
/// in the same order.
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const context_parallel& cp, std::int64_t seq_len, std::int64_t window = 0,
                        const torch::Tensor& documents = {});

/// The same core without a group, for q at global positions `q_positions` ((Lq) int64)
/// and k, v at `k_positions` ((Lk) int64): positions need not be contiguous nor sorted
/// (tests; the allgather and a2a comms run it on what they exchanged). `documents` as
/// above, over the global positions.
torch::Tensor local_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              const torch::Tensor& q_positions, const torch::Tensor& k_positions,
                              std::int64_t window = 0, const torch::Tensor& documents = {});

/// Each token's document number in its sequence, from the documents' positions ((B, S)
/// int64, 0 where a document begins): as many as begin at or before it.
torch::Tensor document_numbers(const torch::Tensor& positions);

/// The ring's (p2p's) shifts in this process since it started, over every rank: how many,
/// and how long the attention waited for them. A shift runs beside the block in hand, so
/// its wait is what the overlap did not hide (with a wait for the peer's side of it). The
/// backward's gradient sums travel a block behind the key/value blocks; its last one is
/// not overlapped. (context_parallel::overlap false: every shift's wait is its whole time.)
struct ring_counters {
  std::int64_t shifts = 0;
  double waited_seconds = 0;
};
ring_counters ring_totals();

}  // namespace cp

}  // namespace troupe
