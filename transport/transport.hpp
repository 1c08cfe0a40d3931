#pragma once
// transport/: moving tensors between ranks and collectives over a group of ranks.
// Knows nothing of models or actors (no CAF): a `communicator` is a group of `size()`
// ranks; every operation is asynchronous and returns a `work` handle.
//
// Backends, one per folder:
//   local/  ranks in one process: hand-off without copy, collectives computed in place
//   ucx/    ranks in processes or on machines: UCX tag messages (shared memory, cma, TCP,
//           RDMA), one progress thread per communicator, ring collectives
//   nccl/   ranks on GPUs (one per rank): NCCL
// and communicators over another one: host_staging.hpp (tensors on any device through
// host copies), ipc/ (point-to-point on one machine through shared buffers, CUDA IPC).
//
// Rules every backend keeps (and checks where it can):
// - Every rank calls the collectives of a communicator in the same order with the same
//   sizes. The UCX backend numbers them and reports a rank that called another collective
//   (or another size) at the same position as an error on both sides instead of hanging.
// - Collectives sum in one fixed order per piece (the ring's: piece i is summed starting at
//   rank i+1 and ending at rank i), so every backend gives bit-identical results.
// - Tensors are contiguous tensors (CPU; local/ takes any device) of one dtype (float32, float64, int32, int64 for
//   sums; any dtype for send/recv/all_gather/broadcast); they must stay alive and unused
//   until the work completes.
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <condition_variable>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <torch/types.h>

namespace troupe::transport {

/// A failed, aborted or timed-out operation.
class transport_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Completion of one asynchronous operation.
class work {
 public:
  using callback = std::function<void(const std::string& error)>;
  explicit work(std::string what) : what_(std::move(what)) {}

  /// Waits up to `timeout`: true once complete; throws transport_error if it failed.
  bool wait(std::chrono::milliseconds timeout);
  /// Waits up to `timeout`; throws transport_error on failure or on timeout.
  void wait_or_throw(std::chrono::milliseconds timeout);
  bool done() const;
  /// Empty while pending or on success.
  std::string error() const;
  /// Calls `cb` once on completion (from the completing thread, or now if done).
  void on_complete(callback cb);
  /// Completes the work with an error (pending transfers are cancelled by the backend).
  void abort(const std::string& why);
  const std::string& what() const { return what_; }

  // --- for backends ---
  /// Marks the work complete (first call wins); runs the callbacks outside the lock.
  void complete(std::string error = {});
  /// Called by abort() before completing (cancel transfers of this work).
  void set_abort_hook(std::function<void()> hook);

 private:
  const std::string what_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::string error_;
  std::vector<callback> callbacks_;
  std::function<void()> abort_hook_;
};
using work_ptr = std::shared_ptr<work>;

/// A work that completes once all of `parts` have (at once when there are none), with the
/// first error among them; aborting it aborts them.
work_ptr all_of(std::vector<work_ptr> parts, const std::string& what);

/// Element range [begin, end) of piece `i` when `n` elements are split into `parts`
/// pieces: the first n % parts pieces have one element more (uneven sizes are allowed).
std::pair<std::int64_t, std::int64_t> piece(std::int64_t n, int parts, int i);

/// Kinds of collective (their numbers travel in the UCX backend's tags).
enum class collective : std::uint8_t { all_reduce = 1, reduce_scatter = 2, all_gather = 3, broadcast = 4 };
const char* collective_name(collective c);

class communicator {
 public:
  virtual ~communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string backend() const = 0;

  /// Point-to-point: `t` to rank `dst`, matched by (source, tag) with the receive.
  virtual work_ptr send(torch::Tensor t, int dst, std::uint32_t tag) = 0;
  /// Receives into the preallocated `t` (its size must be the sent size).
  virtual work_ptr recv(torch::Tensor t, int src, std::uint32_t tag) = 0;

  /// Sum over ranks, in place.
  virtual work_ptr all_reduce(torch::Tensor t) = 0;
  /// `output` (piece(input.numel(), size, rank) long) = this rank's piece of the sum.
  virtual work_ptr reduce_scatter(torch::Tensor input, torch::Tensor output) = 0;
  /// `output` (total long) = every rank's `input` piece, in rank order.
  virtual work_ptr all_gather(torch::Tensor input, torch::Tensor output) = 0;
  /// `t` of rank `root` to every rank.
  virtual work_ptr broadcast(torch::Tensor t, int root) = 0;
  /// All-to-all with per-rank sizes (alltoallv): `input` holds send_counts[0] elements for
  /// rank 0, then send_counts[1] for rank 1, ...; `output` receives recv_counts[s]
  /// elements from each rank s, in rank order. Every rank's send_counts[r] must equal
  /// rank r's recv_counts[this rank]; zero counts move nothing. The default posts every
  /// transfer as a point-to-point send or receive, all in flight together, with a tag of
  /// the reserved range (all_to_all_tag: a per-communicator call number); a backend may do
  /// better (NCCL: grouped send/recv).
  virtual work_ptr all_to_all(torch::Tensor input, const std::vector<std::int64_t>& send_counts, torch::Tensor output,
                              const std::vector<std::int64_t>& recv_counts);

  /// Fails every pending operation with `why` (a peer is gone, the step was aborted).
  virtual void abort(const std::string& why) = 0;

 private:
  std::uint32_t all_to_alls_ = 0;  // calls so far (every rank calls them in the same order)
};

/// Point-to-point tags from this one up are the all-to-alls' (callers use lower tags).
constexpr std::uint32_t all_to_all_tag = 0xA2A00000u;

/// Checks a tensor handed to a collective: contiguous, `numel` elements (-1: any), and on
/// the CPU unless `any_device` (the in-process backend works on any device).
void check_tensor(const torch::Tensor& t, std::int64_t numel, const char* what, bool any_device = false);
/// True for the dtypes collectives can sum.
bool summable(torch::ScalarType t);
/// `out` = sum of the ranks' tensors in the ring's order for piece `i`: rank i+1 first,
/// rank i last (what every backend computes for that piece).
void ring_order_sum(torch::Tensor out, const std::vector<torch::Tensor>& by_rank, int i);

}  // namespace troupe::transport
