#include "transport/algorithms/ring.hpp"

#include <algorithm>

#include <torch/torch.h>

namespace troupe::transport {

torch::Tensor scratch_view(std::vector<torch::Tensor>& scratch, std::size_t i, std::int64_t count,
                           torch::ScalarType dtype) {
  if (scratch.size() <= i) scratch.resize(i + 1);
  const auto bytes = std::max<std::int64_t>(1, count) * std::int64_t(c10::elementSize(dtype));
  auto& t = scratch[i];
  if (!t.defined() || std::int64_t(t.nbytes()) < bytes) t = torch::empty({bytes}, torch::kUInt8);
  return t.narrow(0, 0, count * std::int64_t(c10::elementSize(dtype))).view(dtype);
}

void ring_reduce_scatter(int rank, int n, collective kind, std::uint64_t seq, int step0, torch::Tensor input,
                         torch::Tensor output, std::vector<torch::Tensor>& scratch, const ring_exchange_fn& exchange) {
  const auto total = input.numel();
  const int right = (rank + 1) % n, left = (rank + n - 1) % n;
  const auto longest = piece(total, n, 0);
  const std::int64_t cap = std::max<std::int64_t>(1, longest.second - longest.first);
  auto view = [&](int i) { return scratch_view(scratch, std::size_t(i), cap, input.scalar_type()); };
  // One buffer receives; two hold the partial sums in turn (the one sent at step s is
  // still in flight while step s + 1's sum is made).
  torch::Tensor in = view(0), sums[2] = {view(1), view(2)};
  torch::Tensor outgoing;
  for (int s = 0; s < n - 1; ++s) {
    const int cs = ((rank - s - 1) % n + n) % n, cr = ((rank - s - 2) % n + n) % n;
    auto [sb, se] = piece(total, n, cs);
    auto [rb, re] = piece(total, n, cr);
    if (s == 0) outgoing = input.narrow(0, sb, se - sb);
    auto incoming = in.narrow(0, 0, re - rb);
    // Step s: the partial sum of piece cs to the right, that of piece cr from the left.
    exchange(kind, seq, step0 + s, outgoing, right, incoming, left, {});
    // Own input added; after the last step this is the rank's piece of the whole sum.
    auto sum = s == n - 2 ? output : sums[s % 2].narrow(0, 0, re - rb);
    torch::add_out(sum, input.narrow(0, rb, re - rb), incoming);
    outgoing = sum;
  }
  if (n == 1) output.copy_(input);
}

void ring_all_gather(int rank, int n, collective kind, std::uint64_t seq, int step0, torch::Tensor out,
                     torch::Tensor mine, const ring_exchange_fn& exchange) {
  const auto total = out.numel();
  const int right = (rank + 1) % n, left = (rank + n - 1) % n;
  for (int s = 0; s < n - 1; ++s) {
    // Step s: piece (rank - s) to the right (received at step s - 1, or the own piece),
    // piece (rank - s - 1) from the left, straight into its place.
    const int cs = ((rank - s) % n + n) % n, cr = ((rank - s - 1) % n + n) % n;
    auto [sb, se] = piece(total, n, cs);
    auto [rb, re] = piece(total, n, cr);
    auto slot = out.narrow(0, sb, se - sb);
    const bool first = s == 0 && mine.defined();
    exchange(kind, seq, step0 + s, first ? mine : slot, right, out.narrow(0, rb, re - rb), left, [&] {
      if (first) slot.copy_(mine);
    });
  }
  if (n == 1 && mine.defined()) out.copy_(mine);
}

}  // namespace troupe::transport
