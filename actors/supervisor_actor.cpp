#include "actors/supervisor_actor.hpp"

#include <map>
#include <optional>

#include <caf/all.hpp>

#include "actors/data_loader_actor.hpp"
#include "actors/optimizer_shard_actor.hpp"
#include "actors/stage_actor.hpp"
#include "compute/job_config.hpp"
#include "messages/type_ids.hpp"
#include "transport/local/local_group.hpp"

namespace troupe {

namespace {
constexpr auto reset_timeout = std::chrono::seconds(30);
}

std::vector<std::pair<int, int>> node_slots(int p, int d, int node, int nodes) {
  if (nodes < 1 || (p * d) % nodes != 0)
    throw config_error(std::to_string(nodes) + " nodes need pipeline x data_parallel (" + std::to_string(p) + " x " +
                       std::to_string(d) + ") divisible by the node count: each node hosts an equal share of the stages");
  const int per = p * d / nodes;
  std::vector<std::pair<int, int>> slots;
  for (int i = node * per; i < (node + 1) * per; ++i) slots.emplace_back(i / p, i % p);
  return slots;
}

node_plan local_node_plan(const runtime_context& ctx) {
  node_plan plan;
  std::vector<std::vector<std::shared_ptr<transport::communicator>>> groups;
  for (int k = 0; k < ctx.p; ++k) groups.push_back(transport::make_local_group(ctx.d));
  plan.slots = node_slots(ctx.p, ctx.d, 0, 1);
  for (const auto& [r, k] : plan.slots) plan.comms.push_back(groups[k][r]);
  for (int r = 0; r < ctx.d; ++r) plan.loader_replicas.push_back(r);
  return plan;
}

caf::behavior supervisor_actor(caf::event_based_actor* self, std::shared_ptr<const runtime_context> ctx,
                               std::shared_ptr<job_wiring> wiring, node_plan plan) {
  using child_list = std::vector<std::pair<caf::actor, std::string>>;
  auto children = std::make_shared<child_list>();
  auto store = std::make_shared<snapshot_store>();
  // The wiring covers the whole job; entries of other nodes arrive with wiring_msg.
  wiring->stages.assign(ctx->d, std::vector<caf::actor>(ctx->p));
  wiring->shards.assign(ctx->p, std::vector<caf::actor>(ctx->d));
  wiring->loaders.assign(ctx->d, caf::actor());
  wiring->node = plan.node;
  wiring->world = plan.world;
  // Spawns this node's actors; `step` >= 0: restarted in place, from the snapshots of
  // the state before that step.
  auto spawn_all = [self, ctx, wiring, store, children](const node_plan& plan, std::int64_t step) {
    children->clear();
    auto add = [&](caf::actor a, std::string name) {
      children->emplace_back(a, std::move(name));
      return a;
    };
    // A stage's parameters before `step`: its shards' ranges in rank order (in one
    // process every shard of the stage is in this node's store).
    auto stage_params = [&](int k, std::int64_t step) {
      std::vector<torch::Tensor> flat;
      for (int c = 0; c < ctx->v; ++c) {
        std::vector<torch::Tensor> pieces;
        for (int r = 0; r < ctx->d; ++r) {
          auto snap = store->get(k, r, step);
          if (!snap)
            throw std::runtime_error("no snapshot of shard[stage " + std::to_string(k) + ", rank " +
                                     std::to_string(r) + "] before step " + std::to_string(step + 1));
          pieces.push_back(snap->chunks.at(c).params);
        }
        flat.push_back(torch::cat(pieces));
      }
      return flat;
    };
    node_actors mine;
    mine.node = plan.node;
    for (std::size_t i = 0; i < plan.slots.size(); ++i) {
      const auto [r, k] = plan.slots[i];
      auto from = step >= 0 ? store->get(k, r, step) : nullptr;
      if (step >= 0 && !from)
        throw std::runtime_error("no snapshot of shard[stage " + std::to_string(k) + ", rank " + std::to_string(r) +
                                 "] before step " + std::to_string(step + 1));
      mine.slot_replicas.push_back(r);
      mine.slot_stages.push_back(k);
      mine.shards.push_back(wiring->shards[k][r] =
                                add(spawn_optimizer_shard_actor(self, ctx, wiring, k, r, plan.comms.at(i), store, from),
                                    "shard[stage " + std::to_string(k) + ", rank " + std::to_string(r) + "]"));
      mine.stages.push_back(wiring->stages[r][k] =
                                add(spawn_stage_actor(self, ctx, wiring, r, k, step >= 0 ? stage_params(k, step)
                                                                                         : std::vector<torch::Tensor>{}),
                                    ctx->stage_name(r, k)));
    }
    for (int r : plan.loader_replicas) {
      mine.loader_replicas.push_back(r);
      mine.loaders.push_back(wiring->loaders[r] = add(spawn_data_loader_actor(self, ctx, wiring, r),
                                                      "loader[replica " + std::to_string(r) + "]"));
    }
    spdlog::debug("supervisor of node {}: spawned {} actors", plan.node, children->size());
    return mine;
  };
  auto mine = std::make_shared<node_actors>(spawn_all(plan, -1));
  // A step retried in place (one process): the old actors are killed; when the last
  // one is down, new ones start from the snapshots and the coordinator gets them.
  struct recovery {
    std::int64_t step = -1;
    caf::typed_response_promise<node_actors> promise;
  };
  auto recovering = std::make_shared<std::optional<recovery>>();

  // Rebuilds this node's actors once the old ones are all gone.
  auto rebuild = [=] {
    auto& rec = **recovering;
    try {
      // Fresh in-process communicators: the old ones may be in the middle of a collective.
      *mine = spawn_all(local_node_plan(*ctx), rec.step);
      rec.promise.deliver(*mine);
    } catch (const std::exception& e) {
      rec.promise.deliver(caf::make_error(caf::sec::runtime_error, std::string(e.what())));
    }
    recovering->reset();
  };
  self->set_down_handler([=](const caf::down_msg& msg) {
    // A child that is gone leaves the list (a recovery waits only for the living).
    std::string name = "unknown actor";
    for (auto it = children->begin(); it != children->end(); ++it)
      if (it->first.address() == msg.source) {
        name = it->second;
        children->erase(it);
        break;
      }
    if (*recovering) {
      if (children->empty()) rebuild();
      return;
    }
    if (msg.reason == caf::exit_reason::user_shutdown || msg.reason == caf::exit_reason::normal) return;
    auto coordinator = wiring->coordinator;
    if (coordinator)
      self->send(coordinator, runtime_failure{-1, name, "actor died: " + self->system().render(msg.reason)});
  });
  self->set_exit_handler([=](const caf::exit_msg& msg) {
    for (auto& [h, n] : *children) self->send_exit(h, msg.reason);
    self->quit(msg.reason);
  });
  // The handlers above live as long as this actor's object, which a remote node's proxy
  // may keep after the actor is gone: drop the children's handles at termination, or a
  // detached stage actor is never destroyed and the actor system waits for it forever.
  self->attach_functor([children] { children->clear(); });
  return {
      [=](run_atom) { return *mine; },  // spawned: here are the handles
      [=](recover_atom, std::int64_t step) -> caf::result<node_actors> {
        // Only a one-process job (in-process communicators) is rebuilt in place.
        if (wiring->world) return caf::make_error(caf::sec::runtime_error, std::string("multi-node jobs restart instead"));
        auto rp = self->make_response_promise<node_actors>();
        *recovering = recovery{step, rp};
        if (children->empty()) {
          rebuild();
        } else {
          for (auto& [h, n] : *children) self->send_exit(h, caf::exit_reason::kill);
        }
        return rp;
      },
      [=](const wiring_msg& msg) {
        // Before the first step, while no actor reads the wiring.
        wiring->coordinator = msg.coordinator;
        wiring->nodes.assign(ctx->d, std::vector<int>(ctx->p, 0));
        for (int r = 0; r < ctx->d; ++r)
          for (int k = 0; k < ctx->p; ++k) wiring->nodes[r][k] = msg.nodes.at(std::size_t(r) * ctx->p + k);
        for (int r = 0; r < ctx->d; ++r) {
          wiring->loaders[r] = msg.loaders.at(r);
          for (int k = 0; k < ctx->p; ++k) {
            wiring->stages[r][k] = msg.stages.at(std::size_t(r) * ctx->p + k);
            wiring->shards[k][r] = msg.shards.at(std::size_t(k) * ctx->d + r);
          }
        }
        return true;
      },
      [=](check_atom, const reset_step& msg) {
        // Reset every actor and collect what each still held.
        auto rp = self->make_response_promise<std::vector<reset_report>>();
        auto reports = std::make_shared<std::vector<reset_report>>();
        auto pending = std::make_shared<std::size_t>(children->size());
        for (auto& [h, n] : *children) {
          const std::string name = n;
          self->request(h, reset_timeout, msg)
              .then(
                  [=](const reset_report& rep) mutable {
                    if (!rep.leftovers.empty()) reports->push_back(rep);
                    if (--*pending == 0) rp.deliver(*reports);
                  },
                  [=](caf::error& err) mutable {
                    reports->push_back({name, {"no reset answer: " + self->system().render(err)}});
                    if (--*pending == 0) rp.deliver(*reports);
                  });
        }
        return rp;
      },
      [=](const abort_step& msg) {
        for (auto& [h, n] : *children) self->send(h, msg);
      },
      [=](plant_atom, int replica, int stage) { self->send(wiring->stages.at(replica).at(stage), plant_atom_v); },
  };
}

}  // namespace troupe
