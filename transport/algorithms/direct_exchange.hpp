#pragma once
// Direct-exchange collectives (reduce-scatter, all-gather): every rank sends each other
// rank its piece at once, in one step. Fewer steps than a ring (1 against n - 1), so
// faster for small tensors on several ranks, where each step's latency dominates; the
// backend decides when (ucx_options::direct_max_bytes). Written against one exchange
// step, as the ring is (ring.hpp).
#include <cstdint>
#include <functional>
#include <vector>

#include <torch/types.h>

#include "transport/transport.hpp"

namespace troupe::transport {

/// One step of a direct exchange (collective `kind`, call `seq`, step `step`): sends
/// `to[p]` to every other rank p and receives `from[p]` from it (undefined or empty: that
/// transfer is left out), all in flight at once; `meanwhile` runs once they are under
/// way; returns when all are done.
using all_exchange_fn =
    std::function<void(collective kind, std::uint64_t seq, int step, const std::vector<torch::Tensor>& to,
                       const std::vector<torch::Tensor>& from, const std::function<void()>& meanwhile)>;

/// Reduce-scatter (step 0): this rank's piece of the sum, summed in ring_order_sum's
/// order (every backend's result for that piece), into `output`, which may be the
/// input's own piece. `scratch`: buffers kept by the caller.
void direct_reduce_scatter(int rank, int n, collective kind, std::uint64_t seq, torch::Tensor input,
                           torch::Tensor output, std::vector<torch::Tensor>& scratch, const all_exchange_fn& exchange);

/// All-gather (step `step`) in place over `out`, whose piece `rank` is filled, or is
/// `mine` where defined (sent from there and copied in while the transfers run).
void direct_all_gather(int rank, int n, collective kind, std::uint64_t seq, int step, torch::Tensor out,
                       torch::Tensor mine, const all_exchange_fn& exchange);

}  // namespace troupe::transport
