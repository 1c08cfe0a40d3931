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

void gather_moments(const std::vector<param_entry>& entries, const flat_range& range, const adamw_shard& shard,
                    named_moments& out, bool main_params) {
  std::vector<std::pair<std::map<std::string, torch::Tensor>*, const torch::Tensor*>> parts{
      {&out.exp_avg, &shard.exp_avg()}, {&out.exp_avg_sq, &shard.exp_avg_sq()}};
  if (main_params) parts.emplace_back(&out.main_params, &shard.params());
  for (const auto& piece : shard_pieces(entries, range)) {
    const auto& e = entries[piece.entry];
    if (e.shared_copy) continue;
    for (auto [map, src] : parts) {
      auto& dst = (*map)[e.name];
      if (!dst.defined()) dst = torch::zeros({e.numel}, torch::kFloat32);
      dst.narrow(0, piece.in_param.begin, piece.in_param.size())
          .add_(src->narrow(0, piece.in_shard.begin, piece.in_shard.size()).to(torch::kCPU));  // shards may be on a GPU
    }
  }
}

void restore_shard(const std::vector<param_entry>& entries, const flat_range& range, adamw_shard& shard,
                   const std::map<std::string, torch::Tensor>& params,
                   const std::map<std::string, torch::Tensor>& optim, std::int64_t steps) {
  auto get = [](const std::map<std::string, torch::Tensor>& m, const std::string& name) {
    auto it = m.find(name);
    if (it == m.end()) throw std::runtime_error("checkpoint has no entry " + name);
    return it->second.reshape({-1}).to(torch::kFloat32);
  };
  torch::NoGradGuard no_grad;
  for (const auto& piece : shard_pieces(entries, range)) {
    const auto& name = entries[piece.entry].name;
    auto src = [&](const torch::Tensor& t) { return t.narrow(0, piece.in_param.begin, piece.in_param.size()); };
    auto dst = [&](const torch::Tensor& t) { return t.narrow(0, piece.in_shard.begin, piece.in_shard.size()); };
    dst(shard.params()).copy_(src(get(params, name)));
    dst(shard.exp_avg()).copy_(src(get(optim, "exp_avg." + name)));
    dst(shard.exp_avg_sq()).copy_(src(get(optim, "exp_avg_sq." + name)));
  }
  shard.set_steps(steps);
}

}  // namespace troupe
