#include "transport/hybrid.hpp"

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include <torch/torch.h>

#include "transport/algorithms/ring.hpp"

namespace troupe::transport {

namespace {

/// Tags of the collectives' transfers over the parent: bits 14..27 the call's number (it
/// wraps; a call's transfers end before the next call starts), 12..13 its phase, 0..11 the
/// ring step. Below 2^31 (the UCX backend's user tags) and above every tag the stages use.
constexpr std::uint32_t kTagBase = 0x50000000u;
std::uint32_t ring_tag(std::uint64_t seq, int phase, int step) {
  return kTagBase | std::uint32_t((seq & 0x3FFFu) << 14) | std::uint32_t((phase & 3) << 12) | std::uint32_t(step & 0xFFF);
}

/// The phases of a call (a pair of ranks is in one shard group or one replica group,
/// never both, and a call's phases run one after the other: the phase keeps a call's
/// steps apart where one rank moves on while its peer still receives).
enum phase : int { within = 0, across_reduce = 1, across_gather = 2, within_gather = 3 };

class hybrid_comm final : public communicator {
 public:
  hybrid_comm(std::shared_ptr<communicator> parent, int shard, std::chrono::milliseconds timeout)
      : parent_(std::move(parent)), g_(shard), r_(parent_->size() / shard), timeout_(timeout) {
    const int me = parent_->rank();
    rank_ = me % g_;
    replica_ = me / g_;
    for (int i = 0; i < g_; ++i) within_.push_back(replica_ * g_ + i);
    for (int k = 0; k < r_; ++k) across_.push_back(k * g_ + rank_);
    worker_ = std::thread([this] { run(); });
  }
  ~hybrid_comm() override {
    bool busy;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      busy = running_ || !queue_.empty();
    }
    if (busy) abort("the communicator was closed");
    cv_.notify_all();
    worker_.join();
  }

  int rank() const override { return rank_; }
  int size() const override { return g_; }
  std::string backend() const override {
    return "hybrid (shard groups of " + std::to_string(g_) + ", " + std::to_string(r_) + " replicas) over " +
           parent_->backend();
  }

  work_ptr send(torch::Tensor t, int dst, std::uint32_t tag) override {
    return parent_->send(std::move(t), within_.at(member(dst)), tag);
  }
  work_ptr recv(torch::Tensor t, int src, std::uint32_t tag) override {
    return parent_->recv(std::move(t), within_.at(member(src)), tag);
  }

  work_ptr all_reduce(torch::Tensor t) override {
    check_tensor(t, -1, "all_reduce", true);
    if (!summable(t.scalar_type())) throw std::invalid_argument("all_reduce: a dtype collectives cannot sum");
    return queue("all_reduce", [this, t](std::uint64_t seq) {
      auto flat = t.view({-1});
      const auto [b, e] = piece(flat.numel(), g_, rank_);
      auto mine = flat.narrow(0, b, e - b);
      ring_reduce_scatter(rank_, g_, collective::all_reduce, seq, 0, flat, mine, scratch_, exchange(within_, within));
      reduce_across(mine, seq);
      ring_all_gather(rank_, g_, collective::all_reduce, seq, 0, flat, torch::Tensor(),
                      exchange(within_, within_gather));
    });
  }
  work_ptr reduce_scatter(torch::Tensor input, torch::Tensor output) override {
    check_tensor(input, -1, "reduce_scatter input", true);
    const auto [b, e] = piece(input.numel(), g_, rank_);
    check_tensor(output, e - b, "reduce_scatter output", true);
    if (!summable(input.scalar_type()) || output.scalar_type() != input.scalar_type())
      throw std::invalid_argument("reduce_scatter: a dtype collectives cannot sum, or two dtypes");
    return queue("reduce_scatter", [this, input, output](std::uint64_t seq) {
      auto out = output.view({-1});
      ring_reduce_scatter(rank_, g_, collective::reduce_scatter, seq, 0, input.view({-1}), out, scratch_,
                          exchange(within_, within));
      reduce_across(out, seq);
    });
  }
  work_ptr all_gather(torch::Tensor input, torch::Tensor output) override {
    check_tensor(output, -1, "all_gather output", true);
    const auto [b, e] = piece(output.numel(), g_, rank_);
    check_tensor(input, e - b, "all_gather input", true);
    return queue("all_gather", [this, input, output](std::uint64_t seq) {
      ring_all_gather(rank_, g_, collective::all_gather, seq, 0, output.view({-1}), input.view({-1}),
                      exchange(within_, within_gather));
    });
  }
  work_ptr broadcast(torch::Tensor t, int root) override {
    check_tensor(t, -1, "broadcast", true);
    member(root);
    return queue("broadcast", [this, t, root](std::uint64_t seq) {
      if (t.numel() == 0) return;
      if (rank_ != root) return finish(parent_->recv(t, within_.at(root), ring_tag(seq, within, 0)));
      std::vector<work_ptr> sends;
      for (int i = 0; i < g_; ++i)
        if (i != root) sends.push_back(parent_->send(t, within_.at(i), ring_tag(seq, within, 0)));
      for (auto& w : sends) finish(w);
    });
  }

  void abort(const std::string& why) override {
    std::vector<work_ptr> queued;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (broken_.empty()) broken_ = why;
      for (auto& t : queue_) queued.push_back(t.done);
      queue_.clear();
    }
    parent_->abort(why);  // fails the running call's transfers
    for (auto& w : queued) w->complete("aborted: " + why);
  }

 private:
  int member(int r) const {
    if (r < 0 || r >= g_) throw std::invalid_argument("rank " + std::to_string(r) + " outside the shard group");
    return r;
  }
  /// Waits for one transfer of the running call; throws if it failed or timed out.
  void finish(const work_ptr& w) const {
    if (w) w->wait_or_throw(timeout_);
  }
  /// One ring step among `members` (parent ranks, by their place in the ring).
  ring_exchange_fn exchange(const std::vector<int>& members, int ph) {
    return [this, &members, ph](collective, std::uint64_t seq, int step, torch::Tensor send, int dst,
                                torch::Tensor recv, int src, const std::function<void()>& meanwhile) {
      const auto tag = ring_tag(seq, ph, step);
      work_ptr r, s;
      if (recv.defined() && recv.numel() > 0) r = parent_->recv(recv, members.at(std::size_t(src)), tag);
      if (send.defined() && send.numel() > 0) s = parent_->send(send, members.at(std::size_t(dst)), tag);
      if (meanwhile) meanwhile();
      finish(s);
      finish(r);
    };
  }
  /// Sums `t` (this rank's piece of its shard group's sum) over the replica group, in place.
  void reduce_across(torch::Tensor t, std::uint64_t seq) {
    if (r_ == 1) return;
    const auto [b, e] = piece(t.numel(), r_, replica_);
    ring_reduce_scatter(replica_, r_, collective::all_reduce, seq, 0, t, t.narrow(0, b, e - b), scratch_,
                        exchange(across_, across_reduce));
    ring_all_gather(replica_, r_, collective::all_reduce, seq, 0, t, torch::Tensor(),
                    exchange(across_, across_gather));
  }

  void release_scratch() {
    std::size_t bytes = 0;
    for (const auto& t : scratch_) bytes += t.defined() ? t.nbytes() : 0;
    if (bytes > kKeptScratchBytes) scratch_.clear();
  }
  static constexpr std::size_t kKeptScratchBytes = 4 << 20;  // small collectives keep theirs

  work_ptr queue(const char* what, std::function<void(std::uint64_t)> fn) {
    auto w = std::make_shared<work>(std::string("hybrid ") + what);
    std::string broken;
    {
      std::lock_guard<std::mutex> lock(mu_);
      broken = broken_;
      if (broken.empty()) {
        queue_.push_back({w, seq_++, std::move(fn)});
        cv_.notify_all();
      }
    }
    if (!broken.empty()) w->complete("aborted: " + broken);
    return w;
  }
  void run() {
    for (;;) {
      task next;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopped
        next = std::move(queue_.front());
        queue_.pop_front();
        running_ = true;
      }
      std::string error;
      try {
        torch::NoGradGuard no_grad;
        next.fn(next.seq);
      } catch (const std::exception& e) {
        error = e.what();
      }
      bool idle;
      {
        std::lock_guard<std::mutex> lock(mu_);
        running_ = false;
        if (!error.empty() && broken_.empty()) broken_ = error;  // a half-done ring: later calls would mismatch
        idle = queue_.empty();
      }
      // The ring's piece-sized buffers go once nothing waits: between steps a shard group
      // holds none (3 pieces of a whole-chunk bucket would be 3/g of the chunk per rank).
      if (idle) release_scratch();
      next.done->complete(error);
    }
  }

  std::shared_ptr<communicator> parent_;
  int g_, r_, rank_ = 0, replica_ = 0;
  std::chrono::milliseconds timeout_;
  std::vector<int> within_, across_;  // parent ranks of the shard group and of the replica group
  std::vector<torch::Tensor> scratch_;  // the worker's ring buffers
  std::mutex mu_;
  std::condition_variable cv_;
  struct task {
    work_ptr done;
    std::uint64_t seq;
    std::function<void(std::uint64_t)> fn;
  };
  std::deque<task> queue_;
  std::uint64_t seq_ = 0;
  std::string broken_;
  bool stop_ = false, running_ = false;
  std::thread worker_;
};

}  // namespace

std::shared_ptr<communicator> hybrid_shard_group(std::shared_ptr<communicator> parent, int shard,
                                                 std::chrono::milliseconds timeout) {
  if (!parent) throw std::invalid_argument("hybrid_shard_group: no communicator");
  if (shard < 1 || parent->size() % shard != 0)
    throw std::invalid_argument("hybrid_shard_group: shard groups of " + std::to_string(shard) + " ranks do not divide " +
                                std::to_string(parent->size()));
  if (shard == parent->size()) return parent;
  return std::make_shared<hybrid_comm>(std::move(parent), shard, timeout);
}

}  // namespace troupe::transport
