#include "compute/parallel/context_parallel.hpp"

#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <vector>

#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/autograd.h>
#include <torch/torch.h>

namespace troupe {

cp_comm parse_cp_comm(const std::string& name) {
  if (name == "p2p") return cp_comm::p2p;
  if (name == "a2a") return cp_comm::a2a;
  if (name == "allgather") return cp_comm::allgather;
  throw std::invalid_argument("context_parallel_comm '" + name + "' (expected p2p, a2a or allgather)");
}

const char* cp_comm_name(cp_comm c) {
  switch (c) {
    case cp_comm::p2p: return "p2p";
    case cp_comm::a2a: return "a2a";
    case cp_comm::allgather: return "allgather";
  }
  return "?";
}

namespace cp {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::int64_t chunk_of(std::int64_t seq_len, int size) {
  if (size < 1 || seq_len % (2 * size) != 0)
    throw std::invalid_argument("a sequence of " + std::to_string(seq_len) + " tokens does not cut into 2 x " +
                                std::to_string(size) + " equal chunks");
  return seq_len / (2 * size);
}

/// A run of tokens at consecutive global positions: positions [first, first + len) at
/// local offsets [offset, offset + len).
struct run {
  std::int64_t first, offset, len;
};

/// The runs of `positions` ((L) int64), in order.
std::vector<run> runs_of(const torch::Tensor& positions) {
  const auto p = positions.to(torch::kCPU, torch::kInt64).contiguous();
  const auto* v = p.data_ptr<std::int64_t>();
  std::vector<run> out;
  for (std::int64_t i = 0; i < p.numel(); ++i) {
    if (!out.empty() && v[i] == out.back().first + out.back().len)
      ++out.back().len;
    else
      out.push_back({v[i], i, 1});
  }
  return out;
}

/// Rank `rank`'s two chunks.
std::vector<run> rank_runs(std::int64_t seq_len, int size, int rank) {
  const auto c = chunk_of(seq_len, size);
  return {{rank * c, 0, c}, {(2 * size - 1 - rank) * c, c, c}};
}

enum class seen { none, all, some };

/// How many of the keys of run `k` the queries of run `q` see.
seen relation(const run& q, const run& k, std::int64_t window) {
  const auto q_last = q.first + q.len - 1, k_last = k.first + k.len - 1;
  if (k.first > q_last || (window > 0 && q.first - k_last >= window)) return seen::none;
  if (k_last <= q.first && (window <= 0 || q_last - k.first < window)) return seen::all;
  return seen::some;
}

/// The keys and values (repeated to the query heads) that query run `q` sees of a block,
/// the runs they came from, and the mask where some are hidden (undefined: all seen).
struct visible_keys {
  torch::Tensor k, v, mask;
  std::vector<run> from;
};

visible_keys visible(const run& q, const torch::Tensor& k, const torch::Tensor& v, const std::vector<run>& k_runs,
                     std::int64_t heads, std::int64_t window, const torch::Tensor& documents) {
  visible_keys out;
  std::vector<torch::Tensor> ks, vs;
  bool partial = false;
  for (const auto& r : k_runs) {
    const auto rel = relation(q, r, window);
    if (rel == seen::none) continue;
    partial = partial || rel == seen::some;
    out.from.push_back(r);
    ks.push_back(k.narrow(2, r.offset, r.len));
    vs.push_back(v.narrow(2, r.offset, r.len));
  }
  if (out.from.empty()) return out;
  out.k = ks.size() == 1 ? ks[0] : torch::cat(ks, 2);
  out.v = vs.size() == 1 ? vs[0] : torch::cat(vs, 2);
  if (k.size(1) != heads) {  // grouped-query: head h uses key/value head h / (H / KV)
    out.k = out.k.repeat_interleave(heads / k.size(1), 1);
    out.v = out.v.repeat_interleave(heads / k.size(1), 1);
  }
  if (partial) {  // (the keys' positions only where a mask needs them)
    const auto i64 = torch::TensorOptions().dtype(torch::kInt64);
    std::vector<torch::Tensor> positions;
    for (const auto& r : out.from) positions.push_back(torch::arange(r.first, r.first + r.len, i64));
    const auto qp = torch::arange(q.first, q.first + q.len, i64).unsqueeze(1);
    const auto kp = torch::cat(positions).unsqueeze(0);
    auto mask = kp <= qp;
    if (window > 0) mask = mask.logical_and(qp - kp < window);
    out.mask = mask.to(k.device());
  }
  if (documents.defined()) {  // and only the keys of the query's own document: (B, 1, Lq, Lk)
    std::vector<torch::Tensor> key_docs;
    for (const auto& r : out.from) key_docs.push_back(documents.narrow(1, r.first, r.len));
    const auto kd = key_docs.size() == 1 ? key_docs[0] : torch::cat(key_docs, 1);
    auto same = documents.narrow(1, q.first, q.len).unsqueeze(2).eq(kd.unsqueeze(1)).to(k.device());
    if (out.mask.defined()) same = same.logical_and(out.mask);
    out.mask = same.unsqueeze(1);
  }
  return out;
}

/// The scores of query run `qr` against `keys`, hidden ones minus infinity (fp32).
torch::Tensor scores(const torch::Tensor& qr, const visible_keys& keys, double scale) {
  auto s = torch::matmul(qr, keys.k.transpose(-2, -1)) * scale;
  if (keys.mask.defined()) s = s.masked_fill(keys.mask.logical_not(), -std::numeric_limits<float>::infinity());
  return s;
}

/// The attention of q (runs `q_runs`) to one block of keys and values (runs `k_runs`),
/// merged into `out` (normalized so far) and `lse` (its log-sum-exp), all fp32.
void forward_block(const torch::Tensor& q, const std::vector<run>& q_runs, const torch::Tensor& k,
                   const torch::Tensor& v, const std::vector<run>& k_runs, std::int64_t window,
                   const torch::Tensor& documents, double scale, torch::Tensor& out, torch::Tensor& lse) {
  for (const auto& qr : q_runs) {
    const auto keys = visible(qr, k, v, k_runs, q.size(1), window, documents);
    if (keys.from.empty()) continue;
    const auto s = scores(q.narrow(2, qr.offset, qr.len), keys, scale);
    auto m = std::get<0>(s.max(-1, /*keepdim=*/true));
    m = torch::where(torch::isinf(m), torch::zeros_like(m), m);  // rows that see nothing here
    const auto p = torch::exp(s - m);
    const auto l = p.sum(-1, /*keepdim=*/true);
    const auto o = torch::matmul(p, keys.v) / l.clamp_min(std::numeric_limits<float>::min());
    const auto block_lse = (m + torch::log(l)).squeeze(-1);  // minus infinity where nothing is seen
    auto o_run = out.narrow(2, qr.offset, qr.len);
    auto lse_run = lse.narrow(2, qr.offset, qr.len);
    const auto merged = torch::logaddexp(lse_run, block_lse);
    const auto safe = torch::where(torch::isinf(merged), torch::zeros_like(merged), merged);
    o_run.mul_(torch::exp(lse_run - safe).unsqueeze(-1)).add_(o * torch::exp(block_lse - safe).unsqueeze(-1));
    lse_run.copy_(merged);
  }
}

/// The backward of forward_block, given the final `out`, `lse`, the output's gradient
/// `dout` and delta = rowsum(dout * out): adds to `dq` and to this block's `dk`, `dv`.
void backward_block(const torch::Tensor& q, const std::vector<run>& q_runs, const torch::Tensor& k,
                    const torch::Tensor& v, const std::vector<run>& k_runs, std::int64_t window,
                    const torch::Tensor& documents, double scale, const torch::Tensor& lse, const torch::Tensor& dout,
                    const torch::Tensor& delta, torch::Tensor& dq, torch::Tensor dk, torch::Tensor dv) {
  const auto B = q.size(0), H = q.size(1), KV = k.size(1), hd = q.size(3);
  for (const auto& qr : q_runs) {
    const auto keys = visible(qr, k, v, k_runs, H, window, documents);
    if (keys.from.empty()) continue;
    const auto qs = q.narrow(2, qr.offset, qr.len);
    const auto dos = dout.narrow(2, qr.offset, qr.len);
    const auto p = torch::exp(scores(qs, keys, scale) - lse.narrow(2, qr.offset, qr.len).unsqueeze(-1));
    const auto ds = p * (torch::matmul(dos, keys.v.transpose(-2, -1)) - delta.narrow(2, qr.offset, qr.len).unsqueeze(-1));
    dq.narrow(2, qr.offset, qr.len).add_(torch::matmul(ds, keys.k) * scale);
    auto dk_c = torch::matmul(ds.transpose(-2, -1), qs) * scale;
    auto dv_c = torch::matmul(p.transpose(-2, -1), dos);
    const auto n = dk_c.size(2);
    if (KV != H) {  // the query heads' gradients summed onto their key/value head
      dk_c = dk_c.view({B, KV, H / KV, n, hd}).sum(2);
      dv_c = dv_c.view({B, KV, H / KV, n, hd}).sum(2);
    }
    std::int64_t at = 0;
    for (const auto& r : keys.from) {
      dk.narrow(2, r.offset, r.len).add_(dk_c.narrow(2, at, r.len));
      dv.narrow(2, r.offset, r.len).add_(dv_c.narrow(2, at, r.len));
      at += r.len;
    }
  }
}

torch::Tensor saved_documents(AutogradContext* ctx) {
  return ctx->saved_data.count("documents") ? ctx->saved_data["documents"].toTensor() : torch::Tensor();
}

collective_group& group_at(AutogradContext* ctx) {
  return *reinterpret_cast<collective_group*>(ctx->saved_data["group"].toInt());
}

// cp::ring_totals' counters (nanoseconds).
std::atomic<std::int64_t> ring_shifts{0}, ring_waited_ns{0};

/// A shift of the ring started (start_shift) and not yet waited for (arrived).
struct shift_in_flight {
  torch::Tensor in, out;
  started_collective work;
};

torch::Tensor arrived(shift_in_flight& s);

/// Starts moving `x` to the next rank of the ring (from the previous one into `out`), as
/// the group's non-blocking all-to-all: it goes on while this rank computes. An undefined
/// `x`: nothing. Without `overlap` it is waited for at once.
shift_in_flight start_shift(collective_group& g, const torch::Tensor& x, bool overlap) {
  shift_in_flight s;
  if (!x.defined()) return s;
  const int C = g.size(), r = g.rank();
  std::vector<std::int64_t> send(std::size_t(C), 0), recv(std::size_t(C), 0);
  send[std::size_t((r + 1) % C)] = 1;
  recv[std::size_t((r + C - 1) % C)] = 1;
  s.in = x.contiguous();
  s.out = torch::empty_like(s.in);
  s.work = g.start_all_to_all(s.in.view({1, -1}), send, recv, s.out.view({1, -1}), "ring shift");
  ++ring_shifts;
  if (!overlap) s.out = arrived(s);
  return s;
}

/// The shifted tensor (undefined for a shift of nothing), once it is here: the wait counted.
torch::Tensor arrived(shift_in_flight& s) {
  if (s.work.pending()) {
    const auto t0 = std::chrono::steady_clock::now();
    s.work.wait();
    ring_waited_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
  }
  s.in = torch::Tensor();
  return s.out;
}

/// Autocast off: the cores compute in fp32 whatever the forward's precision.
struct fp32_only {
  c10::impl::ExcludeDispatchKeyGuard no_autocast{c10::autocast_dispatch_keyset};
};

double scale_of(const torch::Tensor& q) { return 1.0 / std::sqrt(double(q.size(3))); }

std::pair<torch::Tensor, torch::Tensor> empty_result(const torch::Tensor& q) {
  auto opts = q.options().dtype(torch::kFloat32);
  return {torch::zeros(q.sizes(), opts),
          torch::full({q.size(0), q.size(1), q.size(2)}, -std::numeric_limits<float>::infinity(), opts)};
}

/// The ring (p2p): block j of rank r is rank (r - j)'s; the next block's shift runs on a
/// thread of its own while this one's attention computes.
struct ring_fn : torch::autograd::Function<ring_fn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const torch::Tensor* numbers, std::int64_t group,
                               std::int64_t seq_len, std::int64_t window, bool overlap) {
    fp32_only guard;
    // (The document numbers as saved data: an undefined tensor is no Function input.)
    const auto documents = numbers ? *numbers : torch::Tensor();
    if (documents.defined()) ctx->saved_data["documents"] = documents;
    auto& g = *reinterpret_cast<collective_group*>(group);
    const int C = g.size(), r = g.rank();
    const auto qf = q.to(torch::kFloat32);
    auto [out, lse] = empty_result(q);
    auto block = torch::stack({k, v}).contiguous();  // sent in the compute dtype
    for (int j = 0; j < C; ++j) {
      auto next = start_shift(g, j + 1 < C ? block : torch::Tensor(), overlap);
      forward_block(qf, rank_runs(seq_len, C, r), block[0].to(torch::kFloat32), block[1].to(torch::kFloat32),
                    rank_runs(seq_len, C, (r - j + C) % C), window, documents, scale_of(q), out, lse);
      if (j + 1 < C) block = arrived(next);
    }
    ctx->save_for_backward({q, k, v, out, lse});
    ctx->saved_data["group"] = group;
    ctx->saved_data["seq_len"] = seq_len;
    ctx->saved_data["window"] = window;
    ctx->saved_data["overlap"] = overlap;
    return out.to(q.scalar_type());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    fp32_only guard;
    const auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4];
    const auto documents = saved_documents(ctx);
    auto& g = group_at(ctx);
    const bool overlap = ctx->saved_data["overlap"].toBool();
    const int C = g.size(), r = g.rank();
    const auto seq_len = ctx->saved_data["seq_len"].toInt(), window = ctx->saved_data["window"].toInt();
    const auto qf = q.to(torch::kFloat32), dout = grads[0].to(torch::kFloat32);
    const auto delta = (dout * out).sum(-1);
    auto dq = torch::zeros_like(qf);
    auto block = torch::stack({k, v}).contiguous();
    // A block's key/value gradient is summed over the ranks as it travels the ring after
    // it, and reaches its owner last. While this rank computes its part of the block in
    // hand, two shifts run beside it (started in this order on every rank): the next
    // block, and the previous block's sum so far. The sum for the block in hand arrives
    // meanwhile: the previous rank's of the same shift.
    torch::Tensor summed;  // the previous block's sum so far, to go on to the next rank
    for (int j = 0; j < C; ++j) {
      const bool more = j + 1 < C;
      auto next = start_shift(g, more ? block : torch::Tensor(), overlap);
      auto sum = start_shift(g, summed, overlap);
      auto part = torch::zeros(block.sizes(), block.options().dtype(torch::kFloat32));
      backward_block(qf, rank_runs(seq_len, C, r), block[0].to(torch::kFloat32), block[1].to(torch::kFloat32),
                     rank_runs(seq_len, C, (r - j + C) % C), window, documents, scale_of(q), lse, dout, delta, dq,
                     part[0], part[1]);
      if (more) block = arrived(next);
      // (The own block, j = 0: no rank before this one has a part of it.)
      summed = summed.defined() ? arrived(sum) + part : part;
    }
    // The last block's sum goes on to the next rank, its owner; this rank's own comes in.
    auto last = start_shift(g, summed, false);
    const auto dblock = arrived(last);
    return {dq.to(q.scalar_type()), dblock[0].to(k.scalar_type()), dblock[1].to(v.scalar_type()),
            torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

/// One block, no group.
struct local_fn : torch::autograd::Function<local_fn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const torch::Tensor& q_positions,
                               const torch::Tensor& k_positions, std::int64_t window, const torch::Tensor* numbers) {
    fp32_only guard;
    const auto documents = numbers ? *numbers : torch::Tensor();
    if (documents.defined()) ctx->saved_data["documents"] = documents;
    auto [out, lse] = empty_result(q);
    forward_block(q.to(torch::kFloat32), runs_of(q_positions), k.to(torch::kFloat32), v.to(torch::kFloat32),
                  runs_of(k_positions), window, documents, scale_of(q), out, lse);
    ctx->save_for_backward({q, k, v, out, lse, q_positions, k_positions});
    ctx->saved_data["window"] = window;
    return out.to(q.scalar_type());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    fp32_only guard;
    const auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4];
    const auto qf = q.to(torch::kFloat32), dout = grads[0].to(torch::kFloat32);
    auto dq = torch::zeros_like(qf);
    auto dk = torch::zeros(k.sizes(), qf.options()), dv = torch::zeros(v.sizes(), qf.options());
    backward_block(qf, runs_of(saved[5]), k.to(torch::kFloat32), v.to(torch::kFloat32), runs_of(saved[6]),
                   ctx->saved_data["window"].toInt(), saved_documents(ctx), scale_of(q), lse, dout, (dout * out).sum(-1),
                   dq, dk, dv);
    return {dq.to(q.scalar_type()), dk.to(k.scalar_type()), dv.to(v.scalar_type()), torch::Tensor(), torch::Tensor(),
            torch::Tensor(), torch::Tensor()};
  }
};

/// All-to-all of equal parts along dim 0 (part s to rank s); its own backward.
struct all_to_all_fn : torch::autograd::Function<all_to_all_fn> {
  static torch::Tensor exchange(collective_group& g, const torch::Tensor& x) {
    std::vector<std::int64_t> rows(std::size_t(g.size()), 1);
    return g.all_to_all(x.contiguous().view({g.size(), -1}), rows, rows).view(x.sizes());
  }
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, std::int64_t group) {
    ctx->saved_data["group"] = group;
    return exchange(*reinterpret_cast<collective_group*>(group), x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {exchange(group_at(ctx), grads[0]), torch::Tensor()};
  }
};

/// Every rank's `x` stacked in rank order; backward: the reduce-scatter of the gradient
/// (summed in fp32).
struct all_gather_fn : torch::autograd::Function<all_gather_fn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, std::int64_t group) {
    auto& g = *reinterpret_cast<collective_group*>(group);
    ctx->saved_data["group"] = group;
    auto sizes = x.sizes().vec();
    sizes.insert(sizes.begin(), g.size());
    auto out = torch::empty(sizes, x.options());
    g.all_gather(x.contiguous(), out);
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto& g = group_at(ctx);
    const auto in = grads[0].to(torch::kFloat32).contiguous();
    auto out = torch::empty(in.sizes().slice(1), in.options());
    g.reduce_scatter(in, out);
    return {out.to(grads[0].scalar_type()), torch::Tensor()};
  }
};

std::int64_t handle(collective_group& g) { return reinterpret_cast<std::int64_t>(&g); }

/// `documents` (B, S) int64 on q's device for the masks, or undefined (one document).
torch::Tensor checked_documents(const torch::Tensor& documents, const torch::Tensor& q) {
  if (!documents.defined()) return {};
  if (documents.dim() != 2 || documents.size(0) != q.size(0))
    throw std::invalid_argument("document numbers of shape " + c10::str(documents.sizes()) + " for " +
                                std::to_string(q.size(0)) + " sequences");
  return documents.to(q.device(), torch::kInt64);
}

/// a2a: (B, X, L, hd) of this rank's tokens and every head -> (B, X / C, C L, hd) of
/// every rank's tokens (rank order) and this rank's X / C heads.
torch::Tensor heads_for_sequence(const torch::Tensor& x, collective_group& g) {
  const auto B = x.size(0), X = x.size(1), L = x.size(2), hd = x.size(3);
  const int C = g.size();
  const auto parts = x.view({B, C, X / C, L, hd}).permute({1, 0, 2, 3, 4});
  return all_to_all_fn::apply(parts, handle(g)).permute({1, 2, 0, 3, 4}).reshape({B, X / C, C * L, hd});
}

/// The inverse: (B, X / C, C L, hd) -> (B, X, L, hd).
torch::Tensor sequence_for_heads(const torch::Tensor& y, collective_group& g) {
  const int C = g.size();
  const auto B = y.size(0), Xc = y.size(1), L = y.size(2) / C, hd = y.size(3);
  const auto parts = y.view({B, Xc, C, L, hd}).permute({2, 0, 1, 3, 4});
  return all_to_all_fn::apply(parts, handle(g)).permute({1, 0, 2, 3, 4}).reshape({B, C * Xc, L, hd});
}

}  // namespace

torch::Tensor local_positions(std::int64_t seq_len, int size, int rank, torch::Device device) {
  const auto c = chunk_of(seq_len, size);
  const auto opts = torch::TensorOptions().dtype(torch::kInt64).device(device);
  return torch::cat({torch::arange(rank * c, (rank + 1) * c, opts),
                     torch::arange((2 * size - 1 - rank) * c, (2 * size - rank) * c, opts)});
}

torch::Tensor all_positions(std::int64_t seq_len, int size, torch::Device device) {
  std::vector<torch::Tensor> parts;
  for (int s = 0; s < size; ++s) parts.push_back(local_positions(seq_len, size, s, device));
  return torch::cat(parts);
}

torch::Tensor local_tokens(const torch::Tensor& x, std::int64_t dim, int size, int rank) {
  const auto c = chunk_of(x.size(dim), size);
  return torch::cat({x.narrow(dim, rank * c, c), x.narrow(dim, (2 * size - 1 - rank) * c, c)}, dim);
}

torch::Tensor document_numbers(const torch::Tensor& positions) {
  return positions.eq(0).to(torch::kInt64).cumsum(/*dim=*/1);
}

ring_counters ring_totals() {
  return {ring_shifts.load(), double(ring_waited_ns.load()) * 1e-9};
}

torch::Tensor local_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              const torch::Tensor& q_positions, const torch::Tensor& k_positions,
                              std::int64_t window, const torch::Tensor& documents) {
  if (q.size(1) % k.size(1) != 0)
    throw std::invalid_argument(std::to_string(q.size(1)) + " query heads over " + std::to_string(k.size(1)) +
                                " key/value heads");
  const auto numbers = checked_documents(documents, q);
  return local_fn::apply(q, k, v, q_positions, k_positions, window, &numbers);
}

torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const context_parallel& cp, std::int64_t seq_len, std::int64_t window,
                        const torch::Tensor& documents) {
  if (!cp.active()) {
    const auto all = torch::arange(seq_len, torch::TensorOptions().dtype(torch::kInt64));
    return local_attention(q, k, v, all, all, window, documents);
  }
  if (documents.defined() && (documents.dim() != 2 || documents.size(1) != seq_len))
    throw std::invalid_argument("document numbers of shape " + c10::str(documents.sizes()) + " for sequences of " +
                                std::to_string(seq_len) + " tokens");
  if (!cp.group || cp.group->size() != cp.size || cp.group->rank() != cp.rank)
    throw std::logic_error("context-parallel rank " + std::to_string(cp.rank) + " of " + std::to_string(cp.size) +
                           " without its group");
  if (q.size(2) * cp.size != seq_len)
    throw std::invalid_argument("context-parallel attention of " + std::to_string(q.size(2)) + " tokens per rank: " +
                                std::to_string(cp.size) + " ranks hold " + std::to_string(seq_len) + " tokens");
  auto& g = *cp.group;
  switch (cp.comm) {
    case cp_comm::p2p: {
      const auto numbers = checked_documents(documents, q);
      return ring_fn::apply(q, k, v, &numbers, handle(g), seq_len, window, cp.overlap);
    }
    case cp_comm::allgather: {
      const auto B = k.size(0), KV = k.size(1), L = k.size(2), hd = k.size(3);
      const auto all = all_gather_fn::apply(torch::stack({k, v}), handle(g));  // (C, 2, B, KV, L, hd)
      auto whole = [&](int i) { return all.select(1, i).permute({1, 2, 0, 3, 4}).reshape({B, KV, cp.size * L, hd}); };
      return local_attention(q, whole(0), whole(1), local_positions(seq_len, cp.size, cp.rank),
                             all_positions(seq_len, cp.size, torch::kCPU), window, documents);
    }
    case cp_comm::a2a: {
      auto kr = k, vr = v;
      if (k.size(1) % cp.size != 0) {  // fewer key/value heads than ranks: each rank's copy of the one it uses
        if (cp.size % k.size(1) != 0)
          throw std::invalid_argument("a2a context parallelism over " + std::to_string(cp.size) + " ranks with " +
                                      std::to_string(k.size(1)) + " key/value heads");
        kr = k.repeat_interleave(cp.size / k.size(1), 1);
        vr = v.repeat_interleave(cp.size / k.size(1), 1);
      }
      if (q.size(1) % cp.size != 0)
        throw std::invalid_argument("a2a context parallelism over " + std::to_string(cp.size) + " ranks with " +
                                    std::to_string(q.size(1)) + " query heads");
      const auto positions = all_positions(seq_len, cp.size, torch::kCPU);
      const auto y = local_attention(heads_for_sequence(q, g), heads_for_sequence(kr, g), heads_for_sequence(vr, g),
                                     positions, positions, window, documents);
      return sequence_for_heads(y, g);
    }
  }
  throw std::logic_error("unknown context-parallel comm");
}

}  // namespace cp

}  // namespace troupe
