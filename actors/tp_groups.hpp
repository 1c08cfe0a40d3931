#pragma once
// Tensor-parallel groups over transport/ communicators: compute/'s collective_group (the
// blocking collectives the parallel layers call) as the transport's asynchronous ones.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>

#include "compute/parallel/collective_group.hpp"
#include "transport/transport.hpp"

namespace troupe {

/// What the members of groups made with `traffic` moved, summed over their ranks.
struct collective_traffic {
  std::atomic<std::int64_t> all_reduce{0};      ///< elements all-reduced (each rank's tensor)
  std::atomic<std::int64_t> all_gather{0};      ///< elements all-gathered (each rank's output)
  std::atomic<std::int64_t> reduce_scatter{0};  ///< elements reduce-scattered (each rank's input)
  std::atomic<std::int64_t> all_to_all{0};      ///< elements all-to-all'ed (each rank's output)
  std::atomic<std::int64_t> calls{0};
  std::atomic<std::int64_t> wait_ns{0};         ///< time the ranks spent in collectives
  /// Bytes a ring moves out of each rank for these (fp32): 2 (T-1)/T of an all-reduce's,
  /// (T-1)/T of an all-gather's output and of a reduce-scatter's input, summed over the ranks.
  double ring_bytes(int size) const;
};

/// Told of every collective a group ran, once it is done: its name ("all-reduce",
/// "all-gather", "reduce-scatter", "all-to-all"), the bytes this rank received of it (an
/// all-reduce: its tensor's), and the seconds the rank waited in it (the trace's events).
using collective_observer = std::function<void(const char* name, std::int64_t bytes, double seconds)>;

/// Told of every collective a group starts, before this rank waits in it: its name.
using collective_entry = std::function<void(const char* name)>;

/// `comm` as a collective_group: each collective is started and waited for (and counted
/// into `traffic`, and told to `enter` and then `observe`, when given). Benchmarks of
/// hiding the all-to-all (tests/bench/experts): every all-to-all lasts `all_to_all_delay`
/// longer, as a network with that latency would (launch_info::all_to_all_delay).
std::shared_ptr<collective_group> as_collective_group(std::shared_ptr<transport::communicator> comm,
                                                      std::shared_ptr<collective_traffic> traffic = nullptr,
                                                      collective_observer observe = nullptr,
                                                      collective_entry enter = nullptr,
                                                      std::chrono::microseconds all_to_all_delay = {});

/// Groups whose ranks are threads of this process (transport/local/: bit-identical sums
/// to the UCX backend's).
std::vector<std::shared_ptr<collective_group>> in_process_groups(int size);
/// The same, counting what they move into `traffic` (benchmarks).
std::vector<std::shared_ptr<collective_group>> counted_in_process_groups(int size,
                                                                         std::shared_ptr<collective_traffic> traffic);

}  // namespace troupe
