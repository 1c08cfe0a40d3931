#pragma once
// ucx/: ranks in different processes or machines. Tensors travel as UCX tag messages
// (UCX picks eager or rendezvous/zero-copy by size, and shared memory, cma, TCP or RDMA
// by what the two ends share; UCX_TLS restricts it). One progress thread per
// communicator progresses the UCX worker: it sleeps on the worker's event fd and
// completes the `work` handles (callers are never blocked). Collectives run on a second
// thread of the communicator, one at a time, in call order; while one runs, that thread
// progresses the worker itself (ucx_options::drive; a mutex serialises the two).
//
// Tags (64 bits): bit 63 collective, bits 48..62 source rank, for collectives bits
// 40..47 the kind, 16..39 the collective's number, 0..15 its step; for point-to-point
// bits 0..31 the user tag. A collective's receive matches everything but the kind, so a
// rank that called another collective at the same number is reported, not waited for.
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "transport/transport.hpp"

namespace troupe::transport {

struct ucx_options {
  /// Every blocking step of a collective fails after this long (a peer died or froze).
  std::chrono::milliseconds timeout{60000};
  /// Progress-loop spins before sleeping on the event fd (latency vs CPU). -1: 0 where
  /// `tls` allows TCP only and more ranks of the communicator share this machine than it
  /// has cores (the kernel moves the
  /// bytes; spinning only takes cores from it: 4 ranks on 2 cores, one-element all-reduce
  /// 320-500 us sleeping, 800-940 spinning), else 2000 (polling pays: shared memory and
  /// RDMA, and TCP with a core per rank: 2 ranks on 2 cores, 47-76 us spinning, 127-222
  /// sleeping).
  int spin = -1;
  /// connect() may leave ranks given an empty address unconnected (the nodes' world,
  /// connected to a node's peers only); without it an empty address is an error.
  bool sparse = false;
  /// UCX_TLS as UCX reads it (launch/ fills it from the environment, with `spin` from
  /// TROUPE_UCX_SPIN: process_ucx_options); "": UCX's default, every transport.
  std::string tls;
  /// UCX peer-failure handling (errors instead of timeouts when a peer dies); UCX 1.13
  /// supports it on TCP and RDMA but not on shared memory, so it is off by default.
  bool peer_failure_handling = false;
  /// Collectives of at most this many bytes (3 ranks or more) exchange every piece
  /// directly (one round of n-1 transfers each way) instead of n-1 ring steps: fewer
  /// latencies, the same bytes per rank, the same sums bit for bit (each piece is still
  /// added in the ring's order, by its owner); scratch of n-1 pieces. 0: always the ring.
  std::int64_t direct_max_bytes = 4 << 20;
  /// While a collective runs, its thread progresses the worker itself (the progress thread
  /// parks): a step's transfers start and their completions are seen without two thread
  /// wake-ups. Only where the progress loop spins (spin > 0); where it sleeps (TCP only,
  /// more ranks than cores) both threads sleep.
  bool drive = true;
};

/// The progress loop's spin count for `requested` (see ucx_options::spin), with
/// `local_ranks` ranks of the communicator on this machine and UCX_TLS `tls`.
int resolve_spin(int requested, int local_ranks = 1, const std::string& tls = "");

/// The options every UCX communicator of this process starts from (prepare_ucx_communicator's
/// default): launch/ sets them once from the environment (TROUPE_UCX_SPIN, UCX_TLS)
/// before any is made; nothing below launch/ reads the environment.
void set_process_ucx_options(const ucx_options& opts);
const ucx_options& process_ucx_options();

/// All-gathers one string per rank (rank order): the bootstrap that exchanges UCX worker
/// addresses, supplied by the caller (the actors' control plane, or a rendezvous folder).
using address_exchange = std::function<std::vector<std::string>(const std::string& mine)>;

/// A communicator in two phases, for callers whose address exchange is asynchronous (the
/// actors' control plane): make the worker, publish `address()`, then `connect()` with
/// every rank's address in rank order. With ucx_options::sparse an empty address leaves
/// that rank unconnected (the nodes' world connects to its peers only): receiving from it
/// still works (for a rank that connected to this one), sending to it fails the work,
/// and so does a collective that would.
class ucx_pending {
 public:
  virtual ~ucx_pending() = default;
  virtual const std::string& address() const = 0;
  virtual std::shared_ptr<communicator> connect(const std::vector<std::string>& addresses) = 0;
};
std::unique_ptr<ucx_pending> prepare_ucx_communicator(int rank, int size, ucx_options opts = process_ucx_options());

/// Creates rank `rank` of `size`: makes a UCX worker, exchanges addresses, connects.
std::shared_ptr<communicator> make_ucx_communicator(int rank, int size, const address_exchange& exchange,
                                                    ucx_options opts = process_ucx_options());

/// The memory types this machine's UCX can move (ucp_context_query): "host" always, "cuda"
/// and others where its build has the modules (Debian's UCX 1.13 has none).
std::vector<std::string> ucx_memory_types();

/// A bootstrap for processes that share a folder (tests, benchmarks, one machine): each
/// rank writes its address to `dir/<rank>` (atomically) and waits up to `timeout` for all.
address_exchange folder_exchange(std::string dir, int rank, int size,
                                 std::chrono::milliseconds timeout = std::chrono::seconds(60));

}  // namespace troupe::transport
