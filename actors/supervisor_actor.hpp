#pragma once
// supervisor_actor: spawns and monitors the actors of its node (the slots of its
// node_plan; in one process: all of them), reports their handles to the coordinator, takes
// the whole job's handles (wiring_msg), and after every committed step resets each actor
// and checks what it still held. An actor that dies is reported to the coordinator.
// Two named behaviors (supervisor_actor.cpp), switched with become():
//
//   serving: (spawn) --run: node_actors--> --wiring_msg--> --check/reset_step--> resets
//        every child, answers what they still held;  down_msg of a child --> runtime_failure
//        to the coordinator
//   serving --recover(step, round)--> recovering: kills every child --last down--> fresh
//        communicators (one process: in-process ones; several nodes: new UCX workers whose
//        addresses go through the registrar as round `round`) --> each stage's parameters
//        before `step` all-gathered from its shards' in-memory snapshots (snapshot.hpp)
//        over the fresh communicators --> new children from the snapshots --node_actors-->
//        serving (the coordinator then sends every node the new handles: wiring_msg).
//        A newer round replaces one under way; an error ends it (back to serving, the
//        coordinator told). A reset check while recovering is refused.
//   a node process restarted after a loss: serving with no children until
//        recover(step, round, buddy): its shards' state before `step` from the buddy
//        (buddy_atom), then recovering as above
//   both: shard_copy (from a shard of the previous node) --> kept, the two newest per
//        shard; buddy_atom(step) --> the copies of the state before `step`; the threads'
//        activity for the hang probe
#include <functional>
#include <memory>

#include <caf/actor_system.hpp>

#include "actors/runtime.hpp"
#include "messages/node_messages.hpp"
#include "transport/transport.hpp"

namespace troupe {

/// What one node hosts: slots (pipeline, stage), each a stage actor and the stage's
/// optimizer shard of that pipeline (with its communicator: the data-parallel group of
/// the stage's tensor-parallel rank), and the data loaders of `loader_replicas`
/// (pipelines, each with its pipeline's first stage).
struct node_plan;

/// A node's fresh communicators for a step retried in place (several nodes), in two
/// phases: made (their addresses, sent to the registrar), then connected to every
/// node's addresses of the same round.
class comm_renewal {
 public:
  virtual ~comm_renewal() = default;
  /// This node's addresses (node_addresses::round is left to the caller).
  virtual node_addresses addresses() const = 0;
  /// The plan with the connected communicators (slots and loaders as before).
  virtual node_plan connect(const node_addresses& table) = 0;
};

struct node_plan {
  int node = 0;
  std::vector<std::pair<int, int>> slots;
  std::vector<std::shared_ptr<transport::communicator>> comms;  ///< per slot
  /// Per slot (expert parallelism, else empty): its shard's expert-data-parallel group, the
  /// shards of stage k of the pipelines q' = q mod EP, q mod EP + EP, ... (which hold the
  /// same experts), rank q / EP.
  std::vector<std::shared_ptr<transport::communicator>> edp_comms;
  /// Per slot: its stage actor's expert-parallel group (parallel.expert_parallel = EP > 1:
  /// the stage actors of replicas EP g .. EP g + EP - 1 at that stage, rank replica mod EP),
  /// in which the experts' all-to-alls of forwards run, and a second one of the same ranks
  /// for those of backwards (expert_parallel::backward_group); empty without expert
  /// parallelism.
  std::vector<std::shared_ptr<transport::communicator>> ep_comms, ep_backward_comms;
  /// Per slot: its stage actor's tensor-parallel group (parallel.tensor_parallel = T > 1:
  /// the stage actors of pipelines T dp .. T dp + T - 1 at that stage, rank pipeline mod
  /// T; in this process: transport/local/); empty without tensor parallelism.
  std::vector<std::shared_ptr<transport::communicator>> tp_comms;
  /// Per slot: its stage actor's context-parallel group (parallel.context_parallel = C >
  /// 1: the stage actors of the replica's C context-parallel ranks at that stage and
  /// tensor-parallel rank, rank cp; in this process: transport/local/); empty without.
  std::vector<std::shared_ptr<transport::communicator>> cp_comms;
  std::vector<int> loader_replicas;
  std::shared_ptr<transport::communicator> world;  ///< between nodes (rank = node); null: one process
  /// Several nodes: where addresses are exchanged, and how to make fresh communicators.
  registrar_actor registrar;
  std::function<std::unique_ptr<comm_renewal>()> renew;
  /// A node process restarted after a loss: no actors (nor communicators) until the
  /// coordinator's recover names the buddy holding its shards' state.
  bool rejoining = false;
};

/// Slots of node `node` of `nodes`: an equal run of the replica-major list of all p x d
/// (replica, stage) pairs (whole replicas when nodes divides d); throws config_error when
/// p x d is not divisible by the node count. Tensor parallelism (`t` > 1): each pair is t
/// slots (pipeline dp t + tp, stage), tp fastest, so that a tensor-parallel group, whose
/// traffic is the heaviest, stays inside one node process where the node count divides
/// p x d; with more nodes (one GPU each) a group spreads over t / (p d t / nodes)
/// consecutive node processes (the node count must then divide p x d x t so).
std::vector<std::pair<int, int>> node_slots(int p, int d, int node, int nodes, int t = 1);
/// node_slots of `cfg`'s layout: with context parallelism its ranks count as replicas
/// (d = data_parallel x context_parallel); a context-parallel group whose ranks land on
/// several nodes meets over UCX. A layout that does not fit throws config_error.
std::vector<std::pair<int, int>> job_slots(const job_config& cfg, int node, int nodes);

/// Every replica in this process, shards (and expert-parallel groups) on in-process
/// communicators.
node_plan local_node_plan(const runtime_context& ctx);
/// The context-parallel groups of `slots` ((pipeline, stage) pairs holding whole groups),
/// in this process: per slot its member.
std::vector<std::shared_ptr<transport::communicator>> context_groups(const runtime_context& ctx,
                                                                    const std::vector<std::pair<int, int>>& slots);

/// Spawns the supervisor of a node (a stateful actor: its state, the children's handles
/// with it, goes when it quits).
supervisor_actor spawn_supervisor_actor(caf::actor_system& sys, std::shared_ptr<const runtime_context> ctx,
                                        std::shared_ptr<job_wiring> wiring, node_plan plan);

}  // namespace troupe
