#pragma once
// Ring collectives (reduce-scatter, all-gather) written against one exchange step, so
// that any backend with point-to-point transfers can run them: the backend moves bytes,
// the algorithm decides who sends what to whom. n - 1 steps; each sends one piece to the
// right neighbour and receives one from the left, so every link carries data at once.
#include <cstdint>
#include <functional>
#include <vector>

#include <torch/types.h>

#include "transport/transport.hpp"

namespace troupe::transport {

/// One step of a ring (collective `kind`, call `seq`, step `step`): sends `send` to rank
/// `dst` and receives `recv` from rank `src` (either undefined: that direction moves
/// nothing); `meanwhile` runs once both are under way; returns when both are done.
using ring_exchange_fn = std::function<void(collective kind, std::uint64_t seq, int step, torch::Tensor send, int dst,
                                            torch::Tensor recv, int src, const std::function<void()>& meanwhile)>;

/// Reduce-scatter of `input` into `output` (piece `rank` of n, as `piece` cuts them),
/// steps step0 .. step0 + n - 2. Step s sends the partial sum of piece (rank - s - 1) (at
/// step 0 the rank's own input piece) and receives the partial sum of piece
/// (rank - s - 2) from the left, adding its own input to it: only piece-sized buffers
/// (from `scratch`, kept by the caller), and the input is not modified. `output` may be
/// the input's own piece.
void ring_reduce_scatter(int rank, int n, collective kind, std::uint64_t seq, int step0, torch::Tensor input,
                         torch::Tensor output, std::vector<torch::Tensor>& scratch, const ring_exchange_fn& exchange);

/// All-gather in place over `out`, whose piece `rank` is filled, or is `mine` where
/// defined: then step 0 sends from `mine` and copies it into place while its transfers
/// run. Steps step0 .. step0 + n - 2.
void ring_all_gather(int rank, int n, collective kind, std::uint64_t seq, int step0, torch::Tensor out,
                     torch::Tensor mine, const ring_exchange_fn& exchange);

/// Buffer `i` of a collective's scratch (fresh large buffers would page-fault on every
/// call), viewed as `count` elements of `dtype`; it grows, never shrinks.
torch::Tensor scratch_view(std::vector<torch::Tensor>& scratch, std::size_t i, std::int64_t count,
                           torch::ScalarType dtype);

}  // namespace troupe::transport
