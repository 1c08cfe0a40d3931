#include "transport/local/local_group.hpp"

#include <map>
#include <tuple>

#include <c10/core/Event.h>
#include <torch/torch.h>

#include "transport/caller_stream.hpp"

namespace troupe::transport {

namespace {

/// Where a GPU tensor's caller stood on its stream when it handed the tensor over: an
/// event recorded there (none for a CPU tensor). The member that runs the operation
/// makes its own stream wait for every other member's before touching their tensors.
using marker = std::shared_ptr<c10::Event>;

marker mark(const torch::Tensor& t) {
  const auto s = caller_stream_of(t);
  if (!s) return nullptr;
  auto ev = std::make_shared<c10::Event>(s->device_type());
  ev->record(*s);
  return ev;
}

/// Runs `f` (copies, sums) on the calling thread's stream of `mine` after every marker,
/// and for GPU tensors waits until it ran: the members' works complete with their
/// tensors written, so each may use them on its own stream at once. On the CPU: `f()`.
template <class F>
void after_markers(const torch::Tensor& mine, const std::vector<marker>& ready, F&& f) {
  const auto s = caller_stream_of(mine);
  if (!s) return f();
  for (const auto& m : ready)
    if (m) m->block(*s);
  f();
  s->synchronize();
}

struct call {
  collective kind;
  torch::Tensor input, output;  // all_reduce / broadcast: input == output
  int root = 0;
  work_ptr done;
  marker ready;
};

struct p2p {
  torch::Tensor t;
  work_ptr done;
  marker ready;
};

/// State shared by the members of one group.
struct group_state {
  explicit group_state(int n) : size(n), seq(n, 0) {}
  const int size;
  std::mutex mu;
  std::string broken;                                       // set by abort()
  std::vector<std::uint64_t> seq;                           // next collective number per rank
  std::map<std::uint64_t, std::vector<call>> collectives;   // by number, one call per rank (indexed)
  std::map<std::uint64_t, std::vector<int>> arrived;        // ranks that called it
  std::map<std::tuple<int, int, std::uint32_t>, std::vector<p2p>> sends, recvs;  // (src, dst, tag)
};

/// The size every rank must agree on (all_gather inputs differ where pieces are uneven).
std::int64_t agreed_size(const call& c) { return c.kind == collective::all_gather ? c.output.numel() : c.input.numel(); }

void run_collective(std::vector<call>& calls) {
  const int n = int(calls.size());
  const auto& first = calls[0];
  for (int r = 1; r < n; ++r) {
    if (calls[r].kind != first.kind || agreed_size(calls[r]) != agreed_size(first) ||
        calls[r].input.scalar_type() != first.input.scalar_type() || calls[r].root != first.root)
      throw transport_error(std::string("collective order mismatch: rank 0 called ") + collective_name(first.kind) +
                            " of " + std::to_string(agreed_size(first)) + " elements, rank " + std::to_string(r) +
                            " " + collective_name(calls[r].kind) + " of " + std::to_string(agreed_size(calls[r])));
  }
  std::vector<torch::Tensor> inputs;
  for (auto& c : calls) inputs.push_back(c.input);
  switch (first.kind) {
    case collective::all_reduce: {
      const auto total = first.input.numel();
      std::vector<torch::Tensor> sums;
      for (int i = 0; i < n; ++i) {
        auto [b, e] = piece(total, n, i);
        std::vector<torch::Tensor> parts;
        for (auto& t : inputs) parts.push_back(t.narrow(0, b, e - b));
        auto sum = torch::empty({e - b}, first.input.options());
        ring_order_sum(sum, parts, i);
        sums.push_back(sum);
      }
      for (auto& c : calls) c.output.copy_(torch::cat(sums));
      break;
    }
    case collective::reduce_scatter:
      for (int r = 0; r < n; ++r) {
        auto [b, e] = piece(first.input.numel(), n, r);
        std::vector<torch::Tensor> parts;
        for (auto& t : inputs) parts.push_back(t.narrow(0, b, e - b));
        ring_order_sum(calls[r].output, parts, r);
      }
      break;
    case collective::all_gather: {
      auto all = torch::cat(inputs);
      for (auto& c : calls) c.output.copy_(all);
      break;
    }
    case collective::broadcast:
      for (int r = 0; r < n; ++r)
        if (r != first.root) calls[r].output.copy_(inputs[first.root]);
      break;
  }
}

class local_member : public communicator {
 public:
  local_member(std::shared_ptr<group_state> g, int rank) : g_(std::move(g)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return g_->size; }
  std::string backend() const override { return "local"; }

  work_ptr send(torch::Tensor t, int dst, std::uint32_t tag) override {
    check_tensor(t, -1, "send", true);
    return match(rank_, dst, tag, std::move(t), true);
  }
  work_ptr recv(torch::Tensor t, int src, std::uint32_t tag) override {
    check_tensor(t, -1, "recv", true);
    return match(src, rank_, tag, std::move(t), false);
  }
  work_ptr all_reduce(torch::Tensor t) override {
    check_sum(t);
    return enter({collective::all_reduce, t, t, 0, nullptr});
  }
  work_ptr reduce_scatter(torch::Tensor input, torch::Tensor output) override {
    check_sum(input);
    auto [b, e] = piece(input.numel(), size(), rank_);
    check_tensor(output, e - b, "reduce_scatter output", true);
    return enter({collective::reduce_scatter, std::move(input), std::move(output), 0, nullptr});
  }
  work_ptr all_gather(torch::Tensor input, torch::Tensor output) override {
    check_tensor(input, -1, "all_gather input", true);
    check_tensor(output, -1, "all_gather output", true);
    auto [b, e] = piece(output.numel(), size(), rank_);
    check_tensor(input, e - b, "all_gather input", true);
    return enter({collective::all_gather, std::move(input), std::move(output), 0, nullptr});
  }
  work_ptr broadcast(torch::Tensor t, int root) override {
    check_tensor(t, -1, "broadcast", true);
    return enter({collective::broadcast, t, t, root, nullptr});
  }
  void abort(const std::string& why) override {
    std::vector<work_ptr> pending;
    {
      std::lock_guard<std::mutex> lock(g_->mu);
      if (g_->broken.empty()) g_->broken = why;
      for (auto& [n, calls] : g_->collectives)
        for (auto& c : calls)
          if (c.done) pending.push_back(c.done);
      for (auto* m : {&g_->sends, &g_->recvs})
        for (auto& [k, q] : *m)
          for (auto& x : q) pending.push_back(x.done);
      g_->collectives.clear();
      g_->arrived.clear();
      g_->sends.clear();
      g_->recvs.clear();
    }
    for (auto& w : pending) w->complete("aborted: " + why);
  }

 private:
  void check_sum(const torch::Tensor& t) {
    check_tensor(t, -1, "collective", true);
    if (!summable(t.scalar_type())) throw std::invalid_argument("collective: dtype cannot be summed");
  }

  work_ptr failed(work_ptr w, const std::string& why) {
    w->complete(why);
    return w;
  }

  work_ptr enter(call c) {
    std::unique_lock<std::mutex> lock(g_->mu);
    const auto n = g_->seq[rank_]++;
    c.done = std::make_shared<work>(std::string(collective_name(c.kind)) + " #" + std::to_string(n) + " (local rank " +
                                    std::to_string(rank_) + ")");
    if (!g_->broken.empty()) return failed(c.done, "communicator aborted: " + g_->broken);
    auto& calls = g_->collectives[n];
    calls.resize(g_->size);
    c.ready = mark(c.input);
    calls[rank_] = c;
    auto& arrived = g_->arrived[n];
    arrived.push_back(rank_);
    if (int(arrived.size()) < g_->size) return c.done;
    auto mine = std::move(calls);
    g_->collectives.erase(n);
    g_->arrived.erase(n);
    lock.unlock();
    std::string error;
    try {
      std::vector<marker> ready;
      for (const auto& x : mine) ready.push_back(x.ready);
      after_markers(c.input, ready, [&] { run_collective(mine); });
    } catch (const std::exception& e) {
      error = e.what();
    }
    for (auto& x : mine) x.done->complete(error);
    return c.done;
  }

  work_ptr match(int src, int dst, std::uint32_t tag, torch::Tensor t, bool is_send) {
    auto w = std::make_shared<work>(std::string(is_send ? "send to " : "recv from ") +
                                    std::to_string(is_send ? dst : src) + " tag " + std::to_string(tag));
    std::unique_lock<std::mutex> lock(g_->mu);
    if (!g_->broken.empty()) return failed(w, "communicator aborted: " + g_->broken);
    const auto key = std::make_tuple(src, dst, tag);
    auto& other = is_send ? g_->recvs[key] : g_->sends[key];
    if (other.empty()) {
      auto ready = mark(t);
      (is_send ? g_->sends[key] : g_->recvs[key]).push_back({std::move(t), w, std::move(ready)});
      return w;
    }
    auto peer = std::move(other.front());
    other.erase(other.begin());
    lock.unlock();
    auto& from = is_send ? t : peer.t;
    auto& into = is_send ? peer.t : t;
    std::string error;
    if (from.numel() != into.numel() || from.scalar_type() != into.scalar_type())
      error = "size mismatch: sent " + std::to_string(from.numel()) + " elements, receiving " +
              std::to_string(into.numel());
    else
      after_markers(t, {peer.ready}, [&] { into.copy_(from); });
    peer.done->complete(error);
    w->complete(error);
    return w;
  }

  std::shared_ptr<group_state> g_;
  const int rank_;
};

}  // namespace

std::vector<std::shared_ptr<communicator>> make_local_group(int size) {
  if (size < 1) throw std::invalid_argument("make_local_group: size must be >= 1");
  auto g = std::make_shared<group_state>(size);
  std::vector<std::shared_ptr<communicator>> members;
  for (int r = 0; r < size; ++r) members.push_back(std::make_shared<local_member>(g, r));
  return members;
}

}  // namespace troupe::transport
