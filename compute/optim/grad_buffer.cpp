#include "compute/optim/grad_buffer.hpp"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <stdexcept>

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

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

namespace {

/// grad_buckets of the region [region.begin, region.end) (its parameters' entries), in order.
/// With `blocks` (each entry's block): a bucket also ends where a block begins (the
/// slice pads each block to a multiple of the ranks in its region).
std::vector<flat_range> region_buckets(const std::vector<param_entry>& entries, flat_range region, int ranks,
                                       std::int64_t bucket_elems, const std::vector<int>& blocks = {}) {
  shard_ranges(region.size(), ranks);  // checks the size
  if (region.size() == 0) return {};
  if (bucket_elems <= 0 && blocks.empty()) return {region};
  std::vector<flat_range> out;
  std::int64_t end = region.end;
  for (std::size_t j = entries.size(); j-- > 0;) {
    const auto& e = entries[j];
    if (e.offset < region.begin || e.offset >= region.end) continue;
    // Where this parameter begins, rounded down (in the region's multiples of the ranks).
    const auto cut = region.begin + (e.offset - region.begin) / ranks * ranks;
    const bool block_begins = !blocks.empty() && j > 0 && blocks[j] != blocks[j - 1];
    if (block_begins && cut != e.offset)
      throw std::logic_error("FSDP by blocks: parameter " + e.name + " begins a block at element " +
                             std::to_string(e.offset) + ", not at a multiple of the " + std::to_string(ranks) +
                             " ranks");
    if (cut > region.begin && (block_begins || (bucket_elems > 0 && end - cut >= bucket_elems))) {
      out.push_back({cut, end});
      end = cut;
    }
  }
  if (end > region.begin) out.push_back({region.begin, end});
  std::reverse(out.begin(), out.end());
  return out;
}

}  // namespace

std::vector<flat_range> grad_buckets(const std::vector<param_entry>& entries, std::int64_t padded_size, int ranks,
                                     std::int64_t bucket_elems) {
  auto out = region_buckets(entries, {0, padded_size}, ranks, bucket_elems);
  return out.empty() ? std::vector<flat_range>{{0, 0}} : out;
}

std::vector<flat_range> slice_buckets(const model_slice& slice, const shard_groups& g, std::int64_t bucket_elems,
                                      bool by_blocks) {
  const auto n = slice.flat_grads().numel(), split = std::min(g.expert_offset, n);
  std::vector<int> blocks;
  if (by_blocks)
    for (std::size_t i = 0; i < slice.entries().size(); ++i) blocks.push_back(slice.entry_block(i));
  auto out = region_buckets(slice.entries(), {0, split}, g.ranks, bucket_elems, blocks);
  const auto experts = region_buckets(slice.entries(), {split, n}, g.expert_ranks, bucket_elems, blocks);
  out.insert(out.end(), experts.begin(), experts.end());
  return out;
}

shard_layout bucket_shard(const std::vector<flat_range>& buckets, int ranks, int rank) {
  return bucket_shard(buckets, shard_groups{ranks, rank});
}

shard_layout bucket_shard(const std::vector<flat_range>& buckets, const shard_groups& g) {
  shard_layout out;
  for (const auto& b : buckets) {
    const int ranks = g.ranks_of(b), rank = g.rank_of(b);
    if (b.size() % ranks != 0) throw std::invalid_argument("a gradient bucket's size must be a multiple of the ranks");
    const auto piece = b.size() / ranks;
    out.push_back({b.begin + rank * piece, b.begin + (rank + 1) * piece});
  }
  return out;
}

std::int64_t shard_size(const shard_layout& shard) {
  std::int64_t n = 0;
  for (const auto& r : shard) n += r.size();
  return n;
}

torch::Tensor from_rank_order(const torch::Tensor& gathered, const std::vector<flat_range>& buckets, int ranks) {
  return from_rank_order(gathered, buckets, shard_groups{ranks, 0});
}

torch::Tensor from_rank_order(const torch::Tensor& gathered, const std::vector<flat_range>& buckets,
                              const shard_groups& g) {
  if (buckets.size() <= 1) return gathered;
  auto out = torch::empty_like(gathered);
  const auto n = gathered.numel(), split = std::min(g.expert_offset, n);
  // Each region: its ranks' shards one after the other, from `base`.
  for (const bool experts : {false, true}) {
    const std::int64_t base = experts ? split : 0, size = experts ? n - split : split;
    const int ranks = experts ? g.expert_ranks : g.ranks;
    std::vector<flat_range> mine;
    for (const auto& b : buckets)
      if (g.in_experts(b) == experts) mine.push_back(b);
    for (int r = 0; r < ranks; ++r) {
      std::int64_t at = base + r * (size / ranks);  // rank r's shard in `gathered`
      for (const auto& piece : bucket_shard(mine, ranks, r)) {
        out.narrow(0, piece.begin, piece.size()).copy_(gathered.narrow(0, at, piece.size()));
        at += piece.size();
      }
    }
  }
  return out;
}

std::vector<shard_piece> shard_pieces(const std::vector<param_entry>& entries, const shard_layout& shard) {
  std::vector<shard_piece> out;
  std::int64_t base = 0;  // where the range starts in the shard
  for (const auto& range : shard) {
    for (std::size_t i = 0; i < entries.size(); ++i) {
      const auto& e = entries[i];
      const auto begin = std::max(e.offset, range.begin);
      const auto end = std::min(e.offset + e.numel, range.end);
      if (begin >= end) continue;
      out.push_back({i, {begin - e.offset, end - e.offset}, {base + begin - range.begin, base + end - range.begin}});
    }
    base += range.size();
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
torch::Tensor mask_of(const std::vector<param_entry>& entries, const shard_layout& shard, Pred pred) {
  auto mask = torch::zeros({shard_size(shard)}, torch::kBool);
  for (const auto& piece : shard_pieces(entries, shard))
    if (pred(entries[piece.entry])) mask.narrow(0, piece.in_shard.begin, piece.in_shard.size()).fill_(true);
  return mask;
}
}  // namespace

torch::Tensor decay_mask(const std::vector<param_entry>& entries, const shard_layout& shard) {
  return mask_of(entries, shard, [](const param_entry& e) { return e.decay; });
}

torch::Tensor norm_mask(const std::vector<param_entry>& entries, const shard_layout& shard) {
  return mask_of(entries, shard, [](const param_entry& e) { return !e.shared_copy; });
}

std::vector<moment_piece> moment_pieces(const std::vector<param_entry>& entries, const shard_layout& range,
                                        const adamw_shard& shard, bool main_params) {
  std::vector<std::pair<const char*, const torch::Tensor*>> parts{{"exp_avg.", &shard.exp_avg()},
                                                                  {"exp_avg_sq.", &shard.exp_avg_sq()}};
  if (main_params) parts.emplace_back("main.", &shard.params());
  std::vector<moment_piece> out;
  for (const auto& piece : shard_pieces(entries, range)) {
    const auto& e = entries[piece.entry];
    if (e.shared_copy) continue;
    for (auto [prefix, src] : parts)  // shards may be on a GPU; a copy: the shard's state moves on
      out.push_back({prefix + e.name, piece.in_param.begin, e.numel,
                     src->narrow(0, piece.in_shard.begin, piece.in_shard.size())
                         .to(torch::kCPU, torch::kFloat32, /*non_blocking=*/false, /*copy=*/true)});
  }
  return out;
}

void add_moment_piece(named_moments& out, const moment_piece& piece) {
  const auto& name = piece.name;
  auto& map = name.rfind("exp_avg.", 0) == 0 ? out.exp_avg : name.rfind("main.", 0) == 0 ? out.main_params : out.exp_avg_sq;
  auto& dst = map[name.substr(name.find('.') + 1)];
  if (!dst.defined() && piece.offset == 0 && piece.data.numel() == piece.numel) {
    dst = piece.data;  // the whole parameter in one piece (a copy already): no second one
    return;
  }
  if (!dst.defined()) dst = torch::zeros({piece.numel}, torch::kFloat32);
  dst.narrow(0, piece.offset, piece.data.numel()).copy_(piece.data);
}

void gather_moments(const std::vector<param_entry>& entries, const shard_layout& range, const adamw_shard& shard,
                    named_moments& out, bool main_params) {
  for (const auto& piece : moment_pieces(entries, range, shard, main_params)) add_moment_piece(out, piece);
}

void use_main_params(state_dict& model, const named_moments& moments) {
  if (moments.main_params.empty()) return;  // fp32: the parameters are the main ones
  for (auto& [name, t] : model) {
    const auto it = moments.main_params.find(name);
    if (it == moments.main_params.end()) throw std::logic_error("no main parameters of " + name + " from its shards");
    t = it->second.reshape(t.sizes());
  }
}

void restore_shard(const std::vector<param_entry>& entries, const shard_layout& range, adamw_shard& shard,
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

struct grad_ready_watch::state {
  std::mutex mu;  // hooks may run on LibTorch's autograd thread (CUDA)
  bool armed = false;
  std::vector<char> param_done;                 // per parameter, this arming
  std::vector<int> left;                        // per bucket: its parameters still to come
  std::vector<char> reported;                   // per bucket, this arming
  std::vector<std::vector<int>> buckets_of;     // per parameter: the buckets it overlaps
  std::vector<int> params_in;                   // per bucket: how many parameters overlap it
  std::atomic<std::int64_t> early{0};
  callback cb;

  /// The buckets made ready by parameter `i`'s gradient (under mu).
  std::vector<int> on_param(std::size_t i) {
    std::vector<int> ready;
    if (!armed || param_done[i]) return ready;
    param_done[i] = 1;
    for (int b : buckets_of[i])
      if (--left[b] == 0 && !reported[b]) {
        reported[b] = 1;
        ready.push_back(b);
      }
    return ready;
  }
};

namespace {
/// Runs after a parameter's AccumulateGrad node: that parameter's gradient of this
/// backward is in its .grad.
class accumulated_hook : public torch::autograd::FunctionPostHook {
 public:
  accumulated_hook(std::shared_ptr<grad_ready_watch::state> s, std::size_t param) : s_(std::move(s)), param_(param) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    std::vector<int> ready;
    {
      std::lock_guard<std::mutex> lock(s_->mu);
      ready = s_->on_param(param_);
    }
    for (int b : ready) {
      ++s_->early;
      s_->cb(b);
    }
    return outputs;
  }

 private:
  std::shared_ptr<grad_ready_watch::state> s_;
  std::size_t param_;
};
}  // namespace

grad_ready_watch::grad_ready_watch(model_slice& slice, std::vector<flat_range> buckets, callback cb)
    : buckets_(std::move(buckets)), state_(std::make_shared<state>()) {
  const auto& entries = slice.entries();
  auto& s = *state_;
  s.cb = std::move(cb);
  s.param_done.assign(entries.size(), 0);
  s.buckets_of.resize(entries.size());
  s.params_in.assign(buckets_.size(), 0);
  for (std::size_t i = 0; i < entries.size(); ++i)
    for (std::size_t b = 0; b < buckets_.size(); ++b)
      if (entries[i].offset < buckets_[b].end && entries[i].offset + entries[i].numel > buckets_[b].begin) {
        s.buckets_of[i].push_back(int(b));
        ++s.params_in[b];
      }
  s.left = s.params_in;
  s.reported.assign(buckets_.size(), 1);
  for (std::size_t i = 0; i < entries.size(); ++i) {
    // Held here: a parameter keeps only a weak reference to its accumulator, which would
    // otherwise go (hooks and all) whenever no graph uses it.
    auto acc = torch::autograd::impl::grad_accumulator(slice.parameters().at(i));
    if (!acc) throw std::logic_error("grad_ready_watch: parameter " + entries[i].name + " has no gradient accumulator");
    acc->add_post_hook(std::make_unique<accumulated_hook>(state_, i));
    accumulators_.push_back(std::move(acc));
  }
}

grad_ready_watch::~grad_ready_watch() { disarm(); }

void grad_ready_watch::arm() {
  std::vector<int> empty;  // buckets of padding only: ready at once
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    auto& s = *state_;
    s.armed = true;
    std::fill(s.param_done.begin(), s.param_done.end(), 0);
    s.left = s.params_in;
    std::fill(s.reported.begin(), s.reported.end(), 0);
    for (std::size_t b = 0; b < buckets_.size(); ++b)
      if (s.left[b] == 0) {
        s.reported[b] = 1;
        empty.push_back(int(b));
      }
  }
  for (int b : empty) state_->cb(b);
}

void grad_ready_watch::finish() {
  std::vector<int> rest;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    auto& s = *state_;
    for (std::size_t b = 0; b < buckets_.size(); ++b)
      if (!s.armed || !s.reported[b]) rest.push_back(int(b));
    s.armed = false;
    std::fill(s.reported.begin(), s.reported.end(), 1);
  }
  for (int b : rest) state_->cb(b);
}

void grad_ready_watch::disarm() {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->armed = false;
  std::fill(state_->reported.begin(), state_->reported.end(), 1);
}

const std::vector<int>& grad_ready_watch::buckets_holding(std::size_t param) const {
  return state_->buckets_of.at(param);  // fixed once made: no lock
}

std::int64_t grad_ready_watch::reported_early() const { return state_->early.load(); }

}  // namespace troupe
