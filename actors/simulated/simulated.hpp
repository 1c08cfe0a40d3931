#pragma once
// Simulated compute (train.compute = "simulated"): the stage and optimizer shard actors of
// a run whose ops take the time of a cost model instead of computing. The rest of the
// runtime is the real one, unchanged: the coordinator and its step, the supervisors, the
// data loaders, begin_step and the reports, the hang watchdog and its wait-for graphs.
//
// - A simulated stage runs its stage's list of the schedule (fixed-order kinds) in order:
//   each op starts once its inputs are here, as a real stage's, and ends after the
//   modelled time (a timer, no thread held). Activations and gradients are messages
//   that carry their shape and dtype but no data, sent so that they arrive after the
//   link's modelled time. After a chunk's last op its gradient buckets go to its shard
//   (sizes only); once every chunk's parameters are back it reports stage_done.
// - A simulated shard meets the other shards of its data-parallel group in a simulated
//   collective (sim_collective: every member arrives, then each waits the collective's
//   modelled time, the part not hidden behind the backward and the next forward as the
//   planner counts it): the gradients' reduce-scatter once its stage's buckets are in, its
//   norm partial to the coordinator, the clip factor, the optimizer's update, the
//   parameters' all-gather, param_shard to its stage and shard_done.
//
// The cost model is the planner's (compute/plan/planner.hpp: costs_for): a device model
// (train.simulated_device) and the schedule simulated with it. Every modelled wait is
// multiplied by train.simulated_time_scale; what a step takes beyond the modelled
// makespan is the runtime's.
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include <caf/local_actor.hpp>

#include "actors/runtime.hpp"
#include "compute/plan/planner.hpp"

namespace troupe {

/// How long a simulated node's peers hear nothing from it before it is lost
/// (faults.freeze_node): a node process's connection timeout (actors/node.hpp's
/// node_options::connection_timeout), in real time (the control plane's clock).
inline constexpr std::chrono::milliseconds simulated_connection_timeout{5000};

struct sim_groups;

/// The modelled times of a simulated job (runtime_context::simulated), and its shards'
/// simulated collectives (one set per job: every simulated node's shards meet in them).
struct simulated_costs {
  plan::layout_costs model;  ///< per virtual stage, the transfers, the planner's prediction
  std::string device;        ///< the device model's name
  double scale = 1;          ///< train.simulated_time_scale
  std::int64_t buckets_per_chunk = 1;  ///< gradient buckets a stage sends its shard per chunk
  /// A modelled time as a wait (scaled), at least 1 us.
  std::chrono::microseconds wait(double seconds) const;
  /// The modelled step (the planner's prediction), scaled: what a step would take with no
  /// runtime overhead.
  double step_seconds() const { return model.predicted.step_seconds * scale; }
  std::shared_ptr<sim_groups> groups;  ///< the shards' collectives (make_sim_groups)
};

/// One op's modelled time on a virtual stage of costs `c` (a split B: the backward less its
/// weight part; a W: the weight part).
double op_seconds(const plan::stage_costs& c, const pipeline_op& op);

/// The costs of `c`'s layout on its simulated_device. Throws config_error where the job
/// cannot be simulated: not a decoder, a dataflow schedule, weights to load or save, or a
/// layout the planner refuses (its reason). (A simulated run does not evaluate.)
std::shared_ptr<const simulated_costs> make_simulated_costs(const job_config& c, const model_spec& spec);

/// A simulated collective of a group of `size` members (in one process): each member's
/// call `n` (its calls are numbered in order) completes for all of them once every member
/// has arrived, after `seconds` of modelled time (the slowest member's: the last one's
/// arrival is the start). `done(member)` runs under no lock on the last arrival's thread.
class sim_collective {
 public:
  explicit sim_collective(int size) : size_(size) {}
  int size() const { return size_; }
  /// Member `rank` arrives at call `n`: returns true for the last arrival, which gets
  /// every member's rank in `all`.
  bool arrive(std::int64_t n, int rank, std::vector<int>& all);
  /// The members still missing at call `n` (for the wait-for graph).
  std::vector<int> missing(std::int64_t n) const;
  /// Drops every call below `n` (a step's collectives once it is over).
  void forget_below(std::int64_t n);

 private:
  int size_;
  mutable std::mutex m_;
  std::map<std::int64_t, std::vector<int>> arrived_;
};

/// The simulated collectives of a job (one per shard group: (stage, tensor-parallel
/// rank)), made once per job (simulated_costs::groups), and its silent nodes.
struct sim_groups {
  std::vector<std::shared_ptr<sim_collective>> by_group;  ///< [stage * t + tp]
  /// faults.freeze_node: a node silent from now (`on`) until it is lost (off). None of its
  /// actors (its supervisor, stages, shards, loader) answers anything meanwhile, as a
  /// frozen or cut-off node process's would not: the hang probe and a retry's rebuild
  /// wait on them until the node is lost.
  void silence(int node, bool on);
  bool silent(int node) const;

 private:
  mutable std::mutex silent_m_;
  std::set<int> silent_;
};
std::shared_ptr<sim_groups> make_sim_groups(const job_config& c);

/// The simulated nodes of a job (train.simulated_nodes > 1, actors/simulated/nodes.cpp):
/// a supervisor per node with node_slots' share of the actors (node 0's with
/// `node0_wiring`, the coordinator's; every other one a wiring of its own), and a
/// registrar that replaces a lost node (faults.kill_node) with a fresh supervisor, as the
/// launcher restarts a node process. The registrar ends with `coordinator`. (The nodes'
/// shares and the kills are checked by make_simulated_costs.)
struct simulated_node_set {
  std::vector<supervisor_actor> supervisors;
  registrar_actor registrar;
};
simulated_node_set spawn_simulated_nodes(caf::actor_system& sys, std::shared_ptr<const runtime_context> ctx,
                                         std::shared_ptr<job_wiring> node0_wiring, const caf::actor_addr& coordinator);

/// A simulated node's entries of an address exchange, as a node process sends them: per
/// slot (q, k) one of its shard group (stage k's, tensor-parallel rank q mod t; rank q / t)
/// and one of the world (-1), each with an address of simulated_address_bytes, and its
/// world peers (world_peers).
node_addresses simulated_addresses(const runtime_context& ctx, int node, const std::vector<std::pair<int, int>>& slots);
/// A UCX worker address's size (shared memory and TCP: ucp_worker_get_address on this
/// project's VM gives 200-300 bytes; InfiniBand adds to it).
inline constexpr std::size_t simulated_address_bytes = 256;

stage_actor spawn_simulated_stage(caf::local_actor* supervisor, std::shared_ptr<const runtime_context> ctx,
                                  std::shared_ptr<const job_wiring> wiring, int replica, int stage);
shard_actor spawn_simulated_shard(caf::local_actor* supervisor, std::shared_ptr<const runtime_context> ctx,
                                  std::shared_ptr<const job_wiring> wiring, int stage, int rank,
                                  std::shared_ptr<sim_groups> groups);

}  // namespace troupe
