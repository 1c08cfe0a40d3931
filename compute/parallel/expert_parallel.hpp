#pragma once
// Expert parallelism (Megatron's alltoall token dispatcher): each of an expert-parallel
// group's EP ranks computes E/EP of a mixture-of-experts layer's experts, for the tokens
// of every rank of the group.
//
//   dispatch: each rank routes its own tokens (the router is replicated), orders its
//     (token, choice) pairs by expert, tells every rank how many rows it sends for each of
//     that rank's experts (an all-to-all of the counts), then sends the rows (an
//     all-to-all with per-rank sizes);
//   the experts: each rank runs its experts on the rows it received, grouped by expert;
//   combine: the inverse all-to-all brings every result back to the rank of its token,
//     in the order it left; each token sums its choices' weighted results in expert order,
//     as the unsplit layer does.
//
// The all-to-alls are differentiable (the backward is the all-to-all with the sizes
// swapped). A rank that receives no rows works: its experts compute nothing and get no
// gradient, as an expert without tokens does in one process.
#include <cstdint>
#include <vector>

#include <torch/types.h>

#include "compute/parallel/collective_group.hpp"

namespace troupe {

namespace ep {

/// Differentiable all-to-all along dim 0 (collective_group::all_to_all): forward sends
/// send_rows[r] rows to rank r and receives recv_rows[s] from rank s over `g`; backward
/// sends the gradient back the other way over `back` (expert_parallel::backward_group).
torch::Tensor all_to_all(const torch::Tensor& x, collective_group& g, collective_group& back,
                         const std::vector<std::int64_t>& send_rows, const std::vector<std::int64_t>& recv_rows);

/// Where one rank's (token, choice) pairs go and what comes to it.
struct dispatch_plan {
  torch::Tensor order;                     ///< int64: the pairs sent, sorted by expert (stable), as flat indices
  std::vector<std::int64_t> send_rows;     ///< per rank: pairs sent (experts of that rank)
  std::vector<std::int64_t> recv_rows;     ///< per rank: rows received
  /// Per local expert j: the indices of the received rows it computes (rows arrive by
  /// source rank, each source's ordered by expert).
  std::vector<torch::Tensor> rows_of_expert;
  std::int64_t received = 0;
};

/// The plan for `chosen` (N, k) experts of this rank's tokens over `g` (E experts, E/EP
/// per rank; expert E: a pair dropped, not sent): sorts the pairs and exchanges the
/// per-expert counts (one all-to-all). Throws std::invalid_argument when the experts do not split over
/// the group (a slice with such a share is refused before: model_slice).
dispatch_plan plan_dispatch(const torch::Tensor& chosen, int n_experts, collective_group& g);

}  // namespace ep

}  // namespace troupe
