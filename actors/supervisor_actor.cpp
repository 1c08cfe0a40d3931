#include "actors/supervisor_actor.hpp"

#include <atomic>
#include <future>
#include <list>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>

#include <caf/all.hpp>

#include "actors/activity_board.hpp"
#include "actors/data_loader_actor.hpp"
#include "actors/optimizer_shard_actor.hpp"
#include "actors/request_all.hpp"
#include "actors/stage_actor.hpp"
#include "compute/job_config.hpp"
#include "messages/type_ids.hpp"
#include "transport/local/local_group.hpp"

namespace troupe {

namespace {
constexpr auto reset_timeout = std::chrono::seconds(30);
}

std::vector<std::pair<int, int>> node_slots(int p, int d, int node, int nodes, int t) {
  const int total = p * d * t;
  if (nodes < 1 || total % nodes != 0)
    throw config_error(std::to_string(nodes) + " nodes need pipeline x data_parallel" + (t > 1 ? " x tensor_parallel" : "") +
                       " (" + std::to_string(p) + " x " + std::to_string(d) + (t > 1 ? " x " + std::to_string(t) : "") +
                       ") divisible by the node count: each node hosts an equal share of the stages");
  const int per = total / nodes;
  if (!nodes_fit(p, d, t, nodes))
    throw config_error(std::to_string(nodes) + " nodes would host " + std::to_string(per) +
                       " stage actors each, which neither holds whole tensor-parallel groups of " + std::to_string(t) +
                       " nor an equal part of one: use a node count that divides pipeline x data_parallel (" +
                       std::to_string(p * d) + "), or pipeline x data_parallel x tensor_parallel in equal parts of a group");
  std::vector<std::pair<int, int>> slots;
  for (int i = node * per; i < (node + 1) * per; ++i) slots.emplace_back(i / (t * p) * t + i % t, i / t % p);
  return slots;
}

node_plan local_node_plan(const runtime_context& ctx) {
  node_plan plan;
  // The shards' data-parallel groups: one per (stage, tensor-parallel rank), rank dp.
  std::vector<std::vector<std::shared_ptr<transport::communicator>>> groups;
  for (int i = 0; i < ctx.p * ctx.t; ++i) groups.push_back(transport::make_local_group(ctx.d));
  plan.slots = node_slots(ctx.p, ctx.d, 0, 1, ctx.t);
  for (const auto& [q, k] : plan.slots) plan.comms.push_back(groups[k * ctx.t + ctx.tp_of(q)][ctx.dp_of(q)]);
  if (ctx.t > 1) {
    // The stage actors' tensor-parallel groups: one per (replica, stage), rank tp.
    std::map<std::pair<int, int>, std::vector<std::shared_ptr<transport::communicator>>> tp_groups;
    for (const auto& [q, k] : plan.slots) {
      auto& g = tp_groups[{ctx.dp_of(q), k}];
      if (g.empty()) g = transport::make_local_group(ctx.t);
      plan.tp_comms.push_back(g.at(std::size_t(ctx.tp_of(q))));
    }
  }
  const int ep = ctx.cfg.expert_parallel;
  if (ep > 1) {
    // The shards' expert-data-parallel groups: one per (stage, share), rank q / EP.
    std::map<std::pair<int, int>, std::vector<std::shared_ptr<transport::communicator>>> edp_groups;
    for (const auto& [q, k] : plan.slots) {
      auto& g = edp_groups[{k, q % ep}];
      if (g.empty()) g = transport::make_local_group(ctx.edp);
      plan.edp_comms.push_back(g.at(std::size_t(q / ep)));
    }
    // (stage, group, backward) -> the group's members
    std::map<std::tuple<int, int, bool>, std::vector<std::shared_ptr<transport::communicator>>> ep_groups;
    for (const auto& [r, k] : plan.slots)
      for (const bool backward : {false, true}) {
        auto& g = ep_groups[{k, r / ep, backward}];
        if (g.empty()) g = transport::make_local_group(ep);
        (backward ? plan.ep_backward_comms : plan.ep_comms).push_back(g.at(std::size_t(r % ep)));
      }
  }
  for (int q = 0; q < ctx.pipes; ++q) plan.loader_replicas.push_back(q);
  return plan;
}

caf::behavior supervisor_actor(caf::event_based_actor* self, std::shared_ptr<const runtime_context> ctx,
                               std::shared_ptr<job_wiring> wiring, node_plan initial_plan) {
  using child_list = std::vector<std::pair<caf::actor, std::string>>;
  auto children = std::make_shared<child_list>();
  auto store = std::make_shared<snapshot_store>();
  auto buddies = std::make_shared<snapshot_store>();  // copies of the previous node's shards
  // Copies whose tensors are still arriving (by id).
  struct incoming_copy {
    shard_copy copy;
    std::mutex m;
    std::string error;
    std::atomic<int> left{0};
    caf::response_promise promise;
  };
  auto incoming = std::make_shared<std::map<std::uint64_t, std::shared_ptr<incoming_copy>>>();
  auto next_copy = std::make_shared<std::uint64_t>(0);
  auto plan = std::make_shared<node_plan>(std::move(initial_plan));
  // The wiring covers the whole job; entries of other nodes arrive with wiring_msg.
  wiring->stages.assign(ctx->pipes, std::vector<caf::actor>(ctx->p));
  wiring->shards.assign(ctx->p, std::vector<caf::actor>(ctx->pipes));
  wiring->loaders.assign(ctx->pipes, caf::actor());
  wiring->node = plan->node;
  wiring->world = plan->world;
  // Spawns this node's actors on the plan's communicators; `step` >= 0: restarted in
  // place (the job's `round`-th recovery), from the snapshots of the state before that
  // step, each stage with `params` (per slot, per chunk: its parameters before the step).
  auto spawn_all = [self, ctx, wiring, store, children, plan](std::int64_t step, std::int32_t round,
                                                              std::vector<std::vector<torch::Tensor>> params) {
    children->clear();
    auto add = [&](caf::actor a, std::string name) {
      children->emplace_back(a, std::move(name));
      return a;
    };
    node_actors mine;
    mine.node = plan->node;
    if (step >= 0) wiring->generation = round;  // what the replaced actors still report is stale
    for (std::size_t i = 0; i < plan->slots.size(); ++i) {
      const auto [r, k] = plan->slots[i];
      auto from = step >= 0 ? store->get(k, r, step) : nullptr;
      mine.slot_replicas.push_back(r);
      mine.slot_stages.push_back(k);
      mine.shards.push_back(wiring->shards[k][r] =
                                add(spawn_optimizer_shard_actor(self, ctx, wiring, k, r, plan->comms.at(i),
                                                                plan->edp_comms.empty() ? nullptr : plan->edp_comms.at(i),
                                                                store, from),
                                    ctx->shard_name(k, r)));
      mine.stages.push_back(wiring->stages[r][k] =
                                add(spawn_stage_actor(self, ctx, wiring, r, k,
                                                      params.empty() ? std::vector<torch::Tensor>{} : params.at(i),
                                                      plan->ep_comms.empty() ? nullptr : plan->ep_comms.at(i),
                                                      plan->ep_comms.empty() ? nullptr : plan->ep_backward_comms.at(i),
                                                      plan->tp_comms.empty() ? nullptr : plan->tp_comms.at(i)),
                                    ctx->stage_name(r, k)));
    }
    for (int r : plan->loader_replicas) {
      mine.loader_replicas.push_back(r);
      mine.loaders.push_back(wiring->loaders[r] = add(spawn_data_loader_actor(self, ctx, wiring, r),
                                                      ctx->loader_name(r)));
    }
    spdlog::debug("supervisor of node {}: spawned {} actors", plan->node, children->size());
    return mine;
  };
  // A node process restarted after a loss starts without actors: the coordinator's
  // recover (with the buddy that holds its shards' state) spawns them.
  auto mine = std::make_shared<node_actors>();
  mine->node = plan->node;
  if (!plan->rejoining) *mine = spawn_all(-1, 0, {});

  // A step retried in place: the old actors are killed; when the last one is down the
  // node gets fresh communicators, every stage's parameters before the step are
  // all-gathered from its shards' snapshots over them (the shards of a stage may live on
  // other nodes), and new actors start from the snapshots.
  struct recovery {
    std::int64_t step = -1;
    std::int32_t round = 0;
    caf::typed_response_promise<node_actors> promise;
    std::vector<std::vector<torch::Tensor>> params;  // per slot, per chunk (all-gather outputs)
    std::vector<std::shared_ptr<const shard_snapshot>> from;  // kept alive while gathering
    int pending = 0;
    std::string error;
  };
  auto recovering = std::make_shared<std::optional<recovery>>();
  auto retired = std::make_shared<std::list<std::future<void>>>();  // closing old communicators
  auto current = [=](std::int32_t round) { return *recovering && (*recovering)->round == round; };
  auto give_up = [=](const std::string& why) {
    if (!*recovering) return;
    (*recovering)->promise.deliver(caf::make_error(caf::sec::runtime_error, "node " + std::to_string(plan->node) +
                                                                                  ": " + why));
    recovering->reset();
  };
  // Starts the all-gather of every stage's parameters; each completion comes back as
  // (gathered, round, error).
  auto gather = [=] {
    auto& rec = **recovering;
    const auto me = caf::actor_cast<caf::actor>(self);
    std::vector<transport::work_ptr> works;
    for (std::size_t i = 0; i < plan->slots.size(); ++i) {
      const auto [r, k] = plan->slots[i];
      auto snap = store->get(k, r, rec.step);
      if (!snap)
        return give_up("no snapshot of shard[stage " + std::to_string(k) + ", rank " + std::to_string(r) +
                       "] before step " + std::to_string(rec.step + 1));
      rec.from.push_back(snap);
      rec.params.emplace_back();
      for (std::size_t c = 0; c < snap->chunks.size(); ++c) {
        // The dense region over the data-parallel group, the experts' over theirs.
        const auto& piece = snap->chunks[c].params;
        const auto n = snap->stage_numel.at(c), split = snap->stage_expert_offset.at(c);
        auto& whole = rec.params.back().emplace_back(torch::empty({n}, piece.options()));
        const auto dense = split / ctx->d;
        works.push_back(plan->comms.at(i)->all_gather(piece.narrow(0, 0, dense), whole.narrow(0, 0, split)));
        if (split < n)
          works.push_back(plan->edp_comms.at(i)->all_gather(piece.narrow(0, dense, piece.numel() - dense),
                                                            whole.narrow(0, split, n - split)));
      }
    }
    rec.pending = int(works.size());  // every node hosts at least one slot
    for (auto& w : works)
      w->on_complete([me, round = rec.round](const std::string& err) { caf::anon_send(me, gathered_atom_v, round, err); });
  };
  // Replaces the communicators (the old ones may be in the middle of a collective, with
  // messages of the aborted step on their way), then gathers. The old ones are closed on
  // a thread of their own: closing waits up to seconds for transfers UCX cannot cancel
  // (a send whose receiver was killed).
  auto renew = [=] {
    std::vector<std::shared_ptr<transport::communicator>> old = std::move(plan->comms);
    for (auto* ep : {&plan->ep_comms, &plan->ep_backward_comms, &plan->tp_comms, &plan->edp_comms}) {
      old.insert(old.end(), ep->begin(), ep->end());
      ep->clear();
    }
    if (plan->world) old.push_back(std::move(plan->world));
    plan->comms.clear();
    plan->world = nullptr;
    wiring->world = nullptr;
    for (auto& c : old) c->abort("replaced: the step is retried in place");
    retired->remove_if([](std::future<void>& f) { return f.wait_for(std::chrono::seconds(0)) == std::future_status::ready; });
    retired->push_back(std::async(std::launch::async, [old = std::move(old)]() mutable { old.clear(); }));
    try {
      if (!plan->renew) {  // one process: in-process communicators
        *plan = local_node_plan(*ctx);
        return gather();
      }
      std::shared_ptr<comm_renewal> fresh = plan->renew();
      auto addrs = fresh->addresses();
      const auto round = addrs.round = (*recovering)->round;
      // Every node's addresses of this round: a node process that rejoins may take a while.
      const auto wait = std::chrono::seconds(60 + ctx->cfg.rejoin_timeout);
      self->request(plan->registrar, wait, addrs)
          .then(
              [=](const node_addresses& table) {
                if (!current(round)) return;
                try {
                  auto next = fresh->connect(table);
                  next.registrar = plan->registrar;
                  next.renew = plan->renew;
                  *plan = std::move(next);
                  wiring->world = plan->world;
                } catch (const std::exception& e) {
                  return give_up(std::string("fresh communicators: ") + e.what());
                }
                gather();
              },
              [=](caf::error& err) {
                if (current(round)) give_up("address exchange: " + self->system().render(err));
              });
    } catch (const std::exception& e) {
      give_up(std::string("fresh communicators: ") + e.what());
    }
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
      if (children->empty()) renew();
      return;
    }
    if (msg.reason == caf::exit_reason::user_shutdown || msg.reason == caf::exit_reason::normal) return;
    auto coordinator = wiring->coordinator;
    if (coordinator)
      self->send(coordinator,
                 runtime_failure{-1, name, "actor died: " + self->system().render(msg.reason), wiring->generation});
  });
  // Stage actors waiting in an expert-parallel all-to-all or a tensor-parallel collective
  // hold their threads (and read no messages) until a peer joins it: a step given up, or
  // retried in place, fails those collectives first, so that the actors can take their
  // exit or abort.
  auto release_groups = [plan](const std::string& why) {
    for (auto* ep : {&plan->ep_comms, &plan->ep_backward_comms, &plan->tp_comms})
      for (auto& c : *ep)
        if (c) c->abort(why);
  };
  self->set_exit_handler([=](const caf::exit_msg& msg) {
    release_groups("the node is shutting down");
    for (auto& [h, n] : *children) self->send_exit(h, msg.reason);
    self->quit(msg.reason);
  });
  // The handlers above live as long as this actor's object, which a remote node's proxy
  // may keep after the actor is gone: drop the children's handles at termination, or a
  // detached stage actor is never destroyed and the actor system waits for it forever.
  self->attach_functor([children, retired] {
    children->clear();
    retired->clear();  // waits until the old communicators are closed
  });
  // Starts recovery `round` (a newer one replaces one under way: a node was lost during
  // it); nothing when `round` is not newer than the one under way.
  auto start_recovery = [=](std::int64_t step, std::int32_t round) -> std::optional<caf::typed_response_promise<node_actors>> {
    if (*recovering) {
      if ((*recovering)->round >= round) return std::nullopt;
      give_up("recovery round " + std::to_string((*recovering)->round) + " replaced by round " + std::to_string(round));
    }
    auto rp = self->make_response_promise<node_actors>();
    *recovering = recovery{step, round, rp, {}, {}, 0, {}};
    return rp;
  };
  auto stale_round = [](std::int32_t round) {
    return caf::make_error(caf::sec::runtime_error, "recovery round " + std::to_string(round) + " is not the newest");
  };
  return {
      [=](run_atom) { return *mine; },  // spawned: here are the handles
      [=](recover_atom, std::int64_t step, std::int32_t round) -> caf::result<node_actors> {
        auto rp = start_recovery(step, round);
        if (!rp) return stale_round(round);
        if (children->empty()) {
          renew();
        } else {
          release_groups("the step is retried in place");
          for (auto& [h, n] : *children) self->send_exit(h, caf::exit_reason::kill);
        }
        return *rp;
      },
      // This node process was lost and restarted: its shards' state before `step` comes
      // from `buddy` (the next node's supervisor), then the recovery goes on as above.
      [=](recover_atom, std::int64_t step, std::int32_t round, const caf::actor& buddy) -> caf::result<node_actors> {
        if (!children->empty()) return caf::make_error(caf::sec::runtime_error, std::string("not a rejoined node"));
        auto rp = start_recovery(step, round);
        if (!rp) return stale_round(round);
        self->request(buddy, std::chrono::seconds(60), buddy_atom_v, step)
            .then(
                [=](const std::vector<shard_copy>& copies) {
                  if (!current(round)) return;
                  try {
                    for (const auto& c : copies) store->put(c.stage, c.rank, snapshot_of(c));
                  } catch (const std::exception& e) {
                    return give_up(std::string("copies from the buddy node: ") + e.what());
                  }
                  spdlog::info("node {}: state of {} optimizer shard(s) before step {} taken from the buddy node",
                               plan->node, copies.size(), step + 1);
                  renew();
                },
                [=](caf::error& err) {
                  if (current(round)) give_up("copies from the buddy node: " + self->system().render(err));
                });
        return *rp;
      },
      // Buddy copies of the previous node's shards: their tensors come over the nodes'
      // world communicator (UCX); once all are in, the copy is kept (the two newest of
      // each shard) and acknowledged ...
      [=](shard_copy& copy) -> caf::result<bool> {
        auto in = std::make_shared<incoming_copy>();
        in->copy = std::move(copy);
        std::vector<tensor_payload*> remote;
        for (auto* v : {&in->copy.params, &in->copy.exp_avg, &in->copy.exp_avg_sq})
          for (auto& p : *v)
            if (p.src_node >= 0) remote.push_back(&p);
        if (!remote.empty() && !wiring->world)
          return caf::make_error(caf::sec::runtime_error, std::string("no world communicator for a shard copy"));
        const auto id = ++*next_copy;
        in->promise = self->make_response_promise<bool>();
        in->left = int(remote.size()) + 1;
        (*incoming)[id] = in;
        const auto me = caf::actor_cast<caf::actor>(self);
        auto arrived = [in, me, id] {
          if (--in->left == 0) caf::anon_send(me, copied_atom_v, id);
        };
        for (auto* p : remote)
          // Kept in host memory; from a GPU job's shards (CUDA IPC on one machine, staged
          // otherwise) into page-locked memory, reused from step to step by LibTorch's
          // caching host allocator: the shard's step waits for this copy.
          fetch_payload(*wiring, *p, [in, p, arrived](tensor_payload got, const std::string& err) {
            {
              std::lock_guard<std::mutex> lock(in->m);
              if (!err.empty()) in->error = err;
              else *p = std::move(got);
            }
            arrived();
          }, torch::kCPU, /*pinned=*/ctx->device.is_cuda());
        arrived();
        return in->promise;
      },
      [=](copied_atom, std::uint64_t id) {
        auto it = incoming->find(id);
        if (it == incoming->end()) return;
        auto in = it->second;
        incoming->erase(it);
        std::lock_guard<std::mutex> lock(in->m);
        try {
          if (!in->error.empty()) throw std::runtime_error("shard copy: " + in->error);
          buddies->put(in->copy.stage, in->copy.rank, snapshot_of(in->copy));
          in->promise.deliver(true);
        } catch (const std::exception& e) {
          in->promise.deliver(caf::make_error(caf::sec::runtime_error, e.what()));
        }
      },
      // ... and handed to that node's restarted process.
      [=](buddy_atom, std::int64_t step) {
        std::vector<shard_copy> out;
        for (const auto& [key, snap] : buddies->all_before(step)) out.push_back(copy_of(key.first, key.second, *snap));
        return out;
      },
      [=](gathered_atom, std::int32_t round, const std::string& err) {
        if (!current(round)) return;
        auto& rec = **recovering;
        if (!err.empty() && rec.error.empty()) rec.error = err;
        if (--rec.pending > 0) return;
        if (!rec.error.empty()) return give_up("gathering the stages' parameters: " + rec.error);
        try {
          *mine = spawn_all(rec.step, rec.round, std::move(rec.params));
        } catch (const std::exception& e) {
          return give_up(e.what());
        }
        rec.promise.deliver(*mine);
        recovering->reset();
      },
      [=](const wiring_msg& msg) {
        // Before the first step or a retried one, while no actor reads the wiring.
        wiring->coordinator = msg.coordinator;
        const int nodes = int(msg.supervisors.size());
        wiring->buddy_node = nodes > 1 && plan->node > 0 ? (plan->node + 1) % nodes : -1;
        wiring->buddy = wiring->buddy_node >= 0 ? msg.supervisors.at(wiring->buddy_node) : caf::actor();
        wiring->nodes.assign(ctx->pipes, std::vector<int>(ctx->p, 0));
        for (int r = 0; r < ctx->pipes; ++r)
          for (int k = 0; k < ctx->p; ++k) wiring->nodes[r][k] = msg.nodes.at(std::size_t(r) * ctx->p + k);
        for (int r = 0; r < ctx->pipes; ++r) {
          wiring->loaders[r] = msg.loaders.at(r);
          for (int k = 0; k < ctx->p; ++k) {
            wiring->stages[r][k] = msg.stages.at(std::size_t(r) * ctx->p + k);
            wiring->shards[k][r] = msg.shards.at(std::size_t(k) * ctx->pipes + r);
          }
        }
        return true;
      },
      [=](check_atom, const reset_step& msg) {
        // Reset every actor and collect what each still held.
        auto rp = self->make_response_promise<std::vector<reset_report>>();
        auto reports = std::make_shared<std::vector<reset_report>>();
        std::vector<caf::actor> handles;
        auto names = std::make_shared<std::vector<std::string>>();
        for (const auto& [h, n] : *children) {
          handles.push_back(h);
          names->push_back(n);
        }
        request_all<reset_report>(
            self, handles, reset_timeout,
            [reports](std::size_t, reset_report& rep) {
              if (!rep.leftovers.empty()) reports->push_back(rep);
            },
            [reports, rp]() mutable { rp.deliver(*reports); },
            [self, reports, names](std::size_t i, caf::error& err) {
              reports->push_back({(*names)[i], {"no reset answer: " + self->system().render(err)}});
              return true;
            },
            msg);
        return rp;
      },
      [=](const abort_step& msg) {
        release_groups("step " + std::to_string(msg.step + 1) + " aborted: " + msg.reason);
        for (auto& [h, n] : *children) self->send(h, msg);
      },
      // The hang diagnosis: what this process's threads compute in `step` (for the stage
      // actors that cannot answer while inside an op).
      [=](activity_atom, std::int64_t step) { return activity_board::reports(wiring->generation, step); },
      [=](plant_atom, int replica, int stage) { self->send(wiring->stages.at(replica).at(stage), plant_atom_v); },
  };
}

}  // namespace troupe
