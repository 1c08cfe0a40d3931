#pragma once
// What compute/ needs of a group of ranks that compute together (a tensor-parallel or an
// expert-parallel group): four blocking collectives. compute/ knows no transport: whoever composes the layers
// gives them a group (actors/tp_groups.hpp: transport communicators as groups).
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/types.h>

namespace troupe {

/// A collective started and not waited for yet (collective_group::start_all_gather).
/// `wait` blocks until it is done and throws its error. One dropped without a wait is
/// settled: waited for up to a bound (`settle`), errors ignored, so that no transfer
/// writes into memory freed after it (a step aborted first aborts its groups).
class started_collective {
 public:
  started_collective() = default;
  started_collective(std::function<void()> wait, std::function<void()> settle)
      : wait_(std::move(wait)), settle_(std::move(settle)) {}
  started_collective(started_collective&& o) noexcept { *this = std::move(o); }
  started_collective& operator=(started_collective&& o) noexcept {
    if (this != &o) {
      drop();
      wait_ = std::move(o.wait_);
      settle_ = std::move(o.settle_);
      o.wait_ = nullptr;
      o.settle_ = nullptr;
    }
    return *this;
  }
  started_collective(const started_collective&) = delete;
  started_collective& operator=(const started_collective&) = delete;
  ~started_collective() { drop(); }
  bool pending() const { return bool(wait_); }
  void wait() {
    auto w = std::move(wait_);
    wait_ = settle_ = nullptr;
    if (w) w();
  }

 private:
  void drop() noexcept {
    auto s = std::move(settle_);
    wait_ = settle_ = nullptr;
    try {
      if (s) s();
    } catch (...) {
    }
  }
  std::function<void()> wait_, settle_;
};

/// A group of `size()` ranks; this member is rank `rank()`. Every rank calls the same
/// collectives in the same order with tensors of the same size and dtype. The calls block
/// until the group's result is in: each rank must call from a thread of its own (a rank
/// waiting in a collective holds its thread). Sums are computed in one fixed order, so
/// every rank gets bit-identical results.
class collective_group {
 public:
  virtual ~collective_group() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  /// `t` (contiguous) = the sum of every rank's `t`, in place.
  virtual void all_reduce(torch::Tensor t) = 0;
  /// `out` (contiguous, size() times `in`'s elements) = every rank's `in`, in rank order.
  virtual void all_gather(const torch::Tensor& in, torch::Tensor out) = 0;
  /// `out` (contiguous, 1/size() of `in`'s elements) = this rank's piece of the sum of
  /// every rank's `in` (piece i: elements [i n/size, (i+1) n/size)).
  virtual void reduce_scatter(const torch::Tensor& in, torch::Tensor out) = 0;
  /// all_gather, started: it goes on while the caller computes, until its wait (the
  /// group's collectives still pair up in the order they are started). `in` and `out`
  /// must stay until then. `name`: what observers of the group call it. By default it
  /// runs at once.
  virtual started_collective start_all_gather(const torch::Tensor& in, torch::Tensor out,
                                              const char* name = "all-gather") {
    (void)name;
    all_gather(in, std::move(out));
    return {};
  }
  /// all_to_all into `out` (contiguous, the rows recv_rows sum to), started: it goes on
  /// while the caller computes, until its wait, as start_all_gather's. `in` (contiguous)
  /// and `out` must stay until then. By default it runs at once.
  virtual started_collective start_all_to_all(const torch::Tensor& in, const std::vector<std::int64_t>& send_rows,
                                              const std::vector<std::int64_t>& recv_rows, torch::Tensor out,
                                              const char* name = "all-to-all") {
    (void)name;
    out.copy_(all_to_all(in, send_rows, recv_rows));
    return {};
  }
  /// All-to-all with per-rank sizes along dim 0: `in` holds send_rows[0] rows for rank 0,
  /// then send_rows[1] for rank 1, ...; returns recv_rows[s] rows from each rank s in rank
  /// order (the rows' other dimensions and dtype are `in`'s). Rank r's send_rows[q] must
  /// be rank q's recv_rows[r]. Zero rows move nothing.
  virtual torch::Tensor all_to_all(const torch::Tensor& in, const std::vector<std::int64_t>& send_rows,
                                   const std::vector<std::int64_t>& recv_rows) = 0;
  /// Fails the collectives every rank waits in, and the later ones, with `why` (a rank
  /// that failed: the others would wait for it forever).
  virtual void abort(const std::string& why) = 0;
};

/// A model slice's place in its tensor-parallel group (size 1: no tensor parallelism;
/// compute/models/tensor_parallel_layout.hpp says what is split).
struct tensor_parallel {
  int rank = 0;
  int size = 1;
  bool sequence = false;                    ///< sequence parallelism
  std::shared_ptr<collective_group> group;  ///< size > 1: the group's member of this rank
  bool active() const { return size > 1; }
};

/// A model slice's place in its expert-parallel group (size 1: every expert here). Rank r
/// of EP computes experts [r E/EP, (r+1) E/EP) for the tokens of all the group's ranks:
/// each rank routes its own tokens, sends each to its expert's rank and gets the results
/// back (compute/parallel/expert_parallel.hpp).
struct expert_parallel {
  int rank = 0;
  int size = 1;
  std::shared_ptr<collective_group> group;  ///< size > 1: the group's member of this rank
  /// The all-to-alls of backwards (and of a forward recomputed in one): a second group of
  /// the same ranks where a forward and a backward of different micro-batches run at once
  /// (an overlapped pair), so that each group's calls keep one order on every rank.
  /// Null: `group` carries both.
  std::shared_ptr<collective_group> backward_group;
  bool active() const { return size > 1; }
  collective_group& backward() const { return backward_group ? *backward_group : *group; }
};

/// Makes the `size` members of one group whose ranks are threads of this process (member
/// i is rank i).
using group_factory = std::function<std::vector<std::shared_ptr<collective_group>>(int size)>;

}  // namespace troupe
