// Simulated nodes (train.simulated_nodes > 1; actors/simulated/simulated.hpp): the job's
// ranks as that many supervisors in this process, each with the slots node_slots gives a
// node process, and a registrar that stands in for the launcher and node 0's registrar
// when a lost node comes back.
#include <chrono>
#include <map>

#include <caf/all.hpp>
#include <spdlog/spdlog.h>

#include "actors/simulated/simulated.hpp"
#include "actors/node.hpp"
#include "actors/registrar_actor.hpp"
#include "actors/supervisor_actor.hpp"
#include "messages/type_ids.hpp"

namespace troupe {

namespace {

/// Node `node`'s plan: its slots, the loaders of its pipelines' first stages, no
/// communicators (the simulated shards meet in sim_collectives). `rejoining`: a node
/// process started again after a loss (no actors until the coordinator's recover).
node_plan simulated_node_plan(const runtime_context& ctx, int node, bool rejoining, registrar_actor registrar) {
  node_plan plan;
  plan.node = node;
  plan.registrar = std::move(registrar);  // (each recovery's address exchange)
  plan.slots = job_slots(ctx.cfg, node, ctx.cfg.simulated_nodes);
  for (const auto& [r, k] : plan.slots)
    if (k == 0) plan.loader_replicas.push_back(r);
  plan.rejoining = rejoining;
  return plan;
}

struct sim_registrar_state {
  std::shared_ptr<const runtime_context> ctx;
  /// The nodes' supervisors (filled once they are spawned, before the job's first message).
  std::shared_ptr<std::vector<supervisor_actor>> supervisors;
  std::map<int, address_round> rounds;  ///< each recovery's address exchange, as node 0's registrar's
};

using sim_registrar_self = registrar_actor::stateful_pointer<sim_registrar_state>;

/// The registrar of simulated nodes: what the coordinator asks of a registrar (a lost node's
/// replacement: a fresh supervisor without actors, as a node process the launcher starts
/// again); the joining side of the protocol (node processes) is refused. It ends with the
/// coordinator.
registrar_actor::behavior_type sim_registrar_behavior(sim_registrar_self self, std::shared_ptr<const runtime_context> ctx,
                                                      std::shared_ptr<std::vector<supervisor_actor>> supervisors,
                                                      caf::actor_addr coordinator) {
  self->state.ctx = std::move(ctx);
  self->state.supervisors = std::move(supervisors);
  self->monitor(coordinator);
  self->set_down_handler([self](const caf::down_msg&) {
    self->state.supervisors->clear();
    self->state.rounds.clear();
    self->quit();
  });
  const auto refused = [] {
    return caf::make_error(caf::sec::runtime_error, std::string("simulated nodes: no node process joins"));
  };
  return {
      [](clock_atom) { return steady_clock_ns(); },
      [](check_atom, std::int32_t, std::int32_t) {},
      [refused](const node_hello&) -> caf::result<job_offer> { return refused(); },
      // A node's addresses of a recovery: once every node's are in, each gets its part of
      // the table (table_for), as from node 0's registrar.
      [self](const node_addresses& a) -> caf::result<node_addresses> {
        // (A newer round ends the ones before it: a node lost during one never sends.)
        auto& rounds = self->state.rounds;
        for (auto it = rounds.begin(); it != rounds.end() && it->first < a.round; it = rounds.erase(it))
          it->second.fail(caf::make_error(caf::sec::runtime_error, "address round " + std::to_string(it->first) +
                                                                       " replaced by round " + std::to_string(a.round)));
        auto& round = rounds[a.round];
        auto rp = round.add(self, a);
        if (round.nodes() == self->state.ctx->cfg.simulated_nodes) {
          round.deliver();
          rounds.erase(a.round);
        }
        return rp;
      },
      [](const node_ready&) { return true; },
      [self](rejoin_atom, std::int32_t node, const caf::actor&) -> caf::result<caf::actor> {
        auto& s = self->state;
        if (node <= 0 || node >= std::int32_t(s.supervisors->size()))
          return caf::make_error(caf::sec::invalid_argument, "no simulated node " + std::to_string(node));
        auto sup = spawn_supervisor_actor(
            self->system(), s.ctx, std::make_shared<job_wiring>(),
            simulated_node_plan(*s.ctx, node, /*rejoining=*/true, caf::actor_cast<registrar_actor>(self)));
        s.supervisors->at(std::size_t(node)) = sup;
        spdlog::info("simulated node {} started again (a fresh supervisor without actors)", node);
        return caf::actor_cast<caf::actor>(sup);
      },
      [](const node_unfit&) { return true; },
      [self](run_atom) {
        std::vector<caf::actor> out;
        for (const auto& sup : *self->state.supervisors) out.push_back(caf::actor_cast<caf::actor>(sup));
        return out;
      },
  };
}

}  // namespace

simulated_node_set spawn_simulated_nodes(caf::actor_system& sys, std::shared_ptr<const runtime_context> ctx,
                                         std::shared_ptr<job_wiring> node0_wiring, const caf::actor_addr& coordinator) {
  const int n = ctx->cfg.simulated_nodes;
  simulated_node_set out;
  // (The registrar first: each node's plan names it. It reads the supervisors only when
  // asked, after this returns.)
  auto supervisors = std::make_shared<std::vector<supervisor_actor>>();
  out.registrar = sys.spawn(sim_registrar_behavior, ctx, supervisors, coordinator);
  std::vector<node_plan> plans;
  for (int node = 0; node < n; ++node) plans.push_back(simulated_node_plan(*ctx, node, false, out.registrar));
  // The join's address exchange (round 0), as node 0's registrar runs it before any node
  // spawns its actors: every node's entries into one table, and each node its part of it.
  const auto start = std::chrono::steady_clock::now();
  node_addresses table;
  std::vector<node_addresses> sent;
  for (const auto& plan : plans) {
    sent.push_back(simulated_addresses(*ctx, plan.node, plan.slots));
    add_entries(table, sent.back());
  }
  std::size_t delivered = 0;
  for (const auto& mine : sent) delivered += table_for(table, mine).stages.size();
  spdlog::info("simulated nodes: the join's address exchange: {} entries, {} to the {} nodes, in {:.2f} s",
               table.stages.size(), delivered, n,
               std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  for (int node = 0; node < n; ++node)
    out.supervisors.push_back(spawn_supervisor_actor(sys, ctx, node == 0 ? node0_wiring : std::make_shared<job_wiring>(),
                                                     std::move(plans[std::size_t(node)])));
  *supervisors = out.supervisors;
  return out;
}

node_addresses simulated_addresses(const runtime_context& ctx, int node, const std::vector<std::pair<int, int>>& slots) {
  node_addresses a;
  a.node = node;
  auto add = [&](int entry, int rank) {
    a.stages.push_back(entry);
    a.replicas.push_back(rank);
    a.addresses.emplace_back(simulated_address_bytes, 'a');
    a.machines.emplace_back();
    a.gpus.emplace_back();
  };
  for (const auto& [q, k] : slots) add(k * ctx.t + q % ctx.t, q / ctx.t);
  add(-1, node);
  a.peers = world_peers(ctx.p, ctx.d, ctx.cfg.simulated_nodes, ctx.t, node);
  return a;
}

}  // namespace troupe
