#include "compute/grad_buffer.hpp"

#include <stdexcept>

namespace troupe {

std::vector<flat_range> shard_ranges(std::int64_t padded_size, int ranks) {
  if (ranks < 1 || padded_size % ranks != 0)
    throw std::invalid_argument("buffer of " + std::to_string(padded_size) +
                                " elements cannot be split into " + std::to_string(ranks) +
                                " equal shards (pad it to a multiple of the rank count)");
  const auto size = padded_size / ranks;
  std::vector<flat_range> out(ranks);
  for (int r = 0; r < ranks; ++r) out[r] = {r * size, (r + 1) * size};
  return out;
}

std::vector<shard_piece> shard_pieces(const std::vector<param_entry>& entries, const flat_range& shard) {
  std::vector<shard_piece> out;
  for (std::size_t i = 0; i < entries.size(); ++i) {
    const auto& e = entries[i];
    const auto begin = std::max(e.offset, shard.begin);
    const auto end = std::min(e.offset + e.numel, shard.end);
    if (begin >= end) continue;
    out.push_back({i, {begin - e.offset, end - e.offset}, {begin - shard.begin, end - shard.begin}});
  }
  return out;
}

int entry_at(const std::vector<param_entry>& entries, std::int64_t index) {
  // Entries are laid out in order: binary search on offsets.
  auto it = std::upper_bound(entries.begin(), entries.end(), index,
                             [](std::int64_t i, const param_entry& e) { return i < e.offset; });
  if (it == entries.begin()) return -1;
  --it;
  return index < it->offset + it->numel ? int(it - entries.begin()) : -1;
}

namespace {
template <class Pred>
torch::Tensor mask_of(const std::vector<param_entry>& entries, const flat_range& shard, Pred pred) {
  auto mask = torch::zeros({shard.size()}, torch::kBool);
  for (const auto& piece : shard_pieces(entries, shard))
    if (pred(entries[piece.entry])) mask.narrow(0, piece.in_shard.begin, piece.in_shard.size()).fill_(true);
  return mask;
}
}  // namespace

torch::Tensor decay_mask(const std::vector<param_entry>& entries, const flat_range& shard) {
  return mask_of(entries, shard, [](const param_entry& e) { return e.decay; });
}

torch::Tensor norm_mask(const std::vector<param_entry>& entries, const flat_range& shard) {
  return mask_of(entries, shard, [](const param_entry& e) { return !e.shared_copy; });
}

}  // namespace troupe
