#include "transport/algorithms/direct_exchange.hpp"

#include <torch/torch.h>

#include "transport/algorithms/ring.hpp"

namespace troupe::transport {

void direct_reduce_scatter(int rank, int n, collective kind, std::uint64_t seq, torch::Tensor input,
                           torch::Tensor output, std::vector<torch::Tensor>& scratch, const all_exchange_fn& exchange) {
  const auto total = input.numel();
  auto [b, e] = piece(total, n, rank);
  const std::int64_t mine = e - b;
  // Scratch: one piece per other rank, and the sum.
  auto buffer = [&](int i) { return scratch_view(scratch, std::size_t(i), mine, input.scalar_type()); };
  std::vector<torch::Tensor> to(static_cast<std::size_t>(n)), parts(static_cast<std::size_t>(n));
  for (int p = 0; p < n; ++p) {
    auto [pb, pe] = piece(total, n, p);
    to[p] = input.narrow(0, pb, pe - pb);                        // rank p's piece of this rank's input
    parts[p] = p == rank ? input.narrow(0, b, mine) : buffer(p);  // this rank's piece of rank p's
  }
  exchange(kind, seq, 0, to, parts, {});
  auto sum = buffer(n);  // not `output`: it may be one of the parts
  ring_order_sum(sum, parts, rank);
  output.copy_(sum);
}

void direct_all_gather(int rank, int n, collective kind, std::uint64_t seq, int step, torch::Tensor out,
                       torch::Tensor mine, const all_exchange_fn& exchange) {
  std::vector<torch::Tensor> to(static_cast<std::size_t>(n)), from(static_cast<std::size_t>(n));
  auto [b, e] = piece(out.numel(), n, rank);
  auto slot = out.narrow(0, b, e - b);
  for (int p = 0; p < n; ++p) {
    auto [pb, pe] = piece(out.numel(), n, p);
    to[p] = mine.defined() ? mine : slot;  // the own piece to everyone
    from[p] = out.narrow(0, pb, pe - pb);  // rank p's straight into its place
  }
  exchange(kind, seq, step, to, from, [&] {
    if (mine.defined()) slot.copy_(mine);
  });
}

}  // namespace troupe::transport
