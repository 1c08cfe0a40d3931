#include "actors/supervisor_actor.hpp"
#include "actors/simulated/simulated.hpp"

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
#include "actors/stage/stage.hpp"
#include "compute/config/job_config.hpp"
#include "messages/type_ids.hpp"
#include "transport/hybrid.hpp"
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

std::vector<std::shared_ptr<transport::communicator>> context_groups(const runtime_context& ctx,
                                                                    const std::vector<std::pair<int, int>>& slots) {
  // One per (replica, stage, tensor-parallel rank), rank cp.
  std::map<std::tuple<int, int, int>, std::vector<std::shared_ptr<transport::communicator>>> groups;
  std::vector<std::shared_ptr<transport::communicator>> out;
  for (const auto& [q, k] : slots) {
    auto& g = groups[{ctx.data_of(q), k, ctx.tp_of(q)}];
    if (g.empty()) g = transport::make_local_group(ctx.c);
    out.push_back(g.at(std::size_t(ctx.cp_of(q))));
  }
  return out;
}

std::vector<std::pair<int, int>> job_slots(const job_config& cfg, int node, int nodes) {
  // (Context parallelism: a group whose ranks land on several nodes runs over UCX.)
  return node_slots(cfg.pipeline, cfg.data_parallel * cfg.context_parallel, node, nodes, cfg.tensor_parallel);
}

node_plan local_node_plan(const runtime_context& ctx) {
  node_plan plan;
  if (ctx.simulated) {  // no communicators: simulated shards meet in sim_collectives
    plan.slots = node_slots(ctx.p, ctx.d, 0, 1, ctx.t);
    for (int q = 0; q < ctx.pipes; ++q) plan.loader_replicas.push_back(q);
    return plan;
  }
  // The shards' data-parallel groups: one per (stage, tensor-parallel rank), rank dp.
  std::vector<std::vector<std::shared_ptr<transport::communicator>>> groups;
  for (int i = 0; i < ctx.p * ctx.t; ++i) groups.push_back(transport::make_local_group(ctx.d));
  plan.slots = node_slots(ctx.p, ctx.d, 0, 1, ctx.t);
  for (const auto& [q, k] : plan.slots)
    plan.comms.push_back(transport::hybrid_shard_group(groups[k * ctx.t + ctx.tp_of(q)][ctx.dp_of(q)], ctx.g));
  if (ctx.t > 1) {
    // The stage actors' tensor-parallel groups: one per (replica, stage), rank tp.
    std::map<std::pair<int, int>, std::vector<std::shared_ptr<transport::communicator>>> tp_groups;
    for (const auto& [q, k] : plan.slots) {
      auto& g = tp_groups[{ctx.dp_of(q), k}];
      if (g.empty()) g = transport::make_local_group(ctx.t);
      plan.tp_comms.push_back(g.at(std::size_t(ctx.tp_of(q))));
    }
  }
  if (ctx.c > 1) plan.cp_comms = context_groups(ctx, plan.slots);
  const int ep = ctx.cfg.expert_parallel;
  if (ep > 1) {
    // The shards' expert-data-parallel groups: one per (stage, share), rank q / EP.
    std::map<std::pair<int, int>, std::vector<std::shared_ptr<transport::communicator>>> edp_groups;
    for (const auto& [q, k] : plan.slots) {
      auto& g = edp_groups[{k, q % ep}];
      if (g.empty()) g = transport::make_local_group(ctx.edp);
      plan.edp_comms.push_back(transport::hybrid_shard_group(g.at(std::size_t(q / ep)), ctx.eg));
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

namespace {

/// A buddy copy whose tensors are still arriving.
struct incoming_copy {
  shard_copy copy;
  std::mutex m;
  std::string error;
  std::atomic<int> left{0};
  caf::response_promise promise;
};

/// A step retried in place: the old actors are killed; when the last one is down the
/// node gets fresh communicators, every stage's parameters before the step are
/// all-gathered from its shards' snapshots over them (the shards of a stage may live on
/// other nodes), and new actors start from the snapshots.
struct recovery {
  std::int64_t step = -1;
  std::int32_t round = 0;
  caf::typed_response_promise<node_actors> promise;
  std::vector<std::vector<torch::Tensor>> params;  // per slot, per chunk (all-gather outputs)
  std::vector<std::shared_ptr<const shard_snapshot>> from;  // kept alive while gathering
  int pending = 0;
  std::string error;
};

/// The step's relay: the step (and attempt) of the begin_step last forwarded to the
/// children, and their reports of it not yet sent on, with what has come of each kind.
struct relay_state {
  std::int64_t step = -1;
  std::int32_t attempt = 0;
  step_reports pending;
  std::size_t partials = 0, stages = 0, shards = 0;
};

struct supervisor_state {
  std::shared_ptr<const runtime_context> ctx;
  std::shared_ptr<job_wiring> wiring;
  node_plan plan;
  std::vector<std::pair<step_actor, std::string>> children;  // (handle, name)
  node_actors mine;  // the children's handles, as the coordinator gets them
  std::shared_ptr<snapshot_store> store = std::make_shared<snapshot_store>();  // this node's shards' snapshots
  std::shared_ptr<snapshot_store> buddies = std::make_shared<snapshot_store>();  // copies of the previous node's
  std::map<std::uint64_t, std::shared_ptr<incoming_copy>> incoming;  // by id
  std::uint64_t next_copy = 0;
  /// The recovery under way (its round, step, promise and progress), or none: the data of
  /// the recovering behavior; enter_phase() installs the behavior it says (serving: none).
  std::optional<recovery> recovering;
  // Old communicators being closed (a thread each); their destruction waits for them.
  std::list<std::future<void>> retired;
  relay_state relay;
  fault_injector faults;  // faults.freeze_node: decided as the step's begin is relayed
};

using supervisor_self = supervisor_actor::stateful_pointer<supervisor_state>;

/// Spawns this node's actors on the plan's communicators; `step` >= 0: restarted in
/// place (the job's `round`-th recovery), from the snapshots of the state before that
/// step, each stage with `params` (per slot, per chunk: its parameters before the step).
node_actors spawn_all(supervisor_self self, std::int64_t step, std::int32_t round,
                      std::vector<std::vector<torch::Tensor>> params) {
  auto& s = self->state;
  const auto& ctx = s.ctx;
  const auto& plan = s.plan;
  auto& wiring = *s.wiring;
  s.children.clear();
  auto add = [&](const auto& a, std::string name) {  // a child; its plain handle for the coordinator
    s.children.emplace_back(a, std::move(name));
    return caf::actor_cast<caf::actor>(a);
  };
  node_actors mine;
  mine.node = plan.node;
  if (step >= 0) wiring.generation = round;  // what the replaced actors still report is stale
  auto comm_or_null = [](const std::vector<std::shared_ptr<transport::communicator>>& comms, std::size_t i) {
    return comms.empty() ? nullptr : comms.at(i);
  };
  for (std::size_t i = 0; i < plan.slots.size(); ++i) {
    const auto [r, k] = plan.slots[i];
    mine.slot_replicas.push_back(r);
    mine.slot_stages.push_back(k);
    if (ctx->simulated) {
      wiring.shards[k][r] = spawn_simulated_shard(self, ctx, s.wiring, k, r, ctx->simulated->groups);
      mine.shards.push_back(add(wiring.shards[k][r], ctx->shard_name(k, r)));
      wiring.stages[r][k] = spawn_simulated_stage(self, ctx, s.wiring, r, k);
      mine.stages.push_back(add(wiring.stages[r][k], ctx->stage_name(r, k)));
      continue;
    }
    auto from = step >= 0 ? s.store->get(k, r, step) : nullptr;
    wiring.shards[k][r] = spawn_optimizer_shard_actor(self, ctx, s.wiring, k, r, plan.comms.at(i),
                                                      comm_or_null(plan.edp_comms, i), s.store, from);
    mine.shards.push_back(add(wiring.shards[k][r], ctx->shard_name(k, r)));
    wiring.stages[r][k] = spawn_stage_actor(self, ctx, s.wiring, r, k,
                                            params.empty() ? std::vector<torch::Tensor>{} : params.at(i),
                                            comm_or_null(plan.ep_comms, i), comm_or_null(plan.ep_backward_comms, i),
                                            comm_or_null(plan.tp_comms, i), comm_or_null(plan.cp_comms, i),
                                            ctx->shards_grads() ? plan.comms.at(i) : nullptr,
                                            ctx->shards_grads() ? comm_or_null(plan.edp_comms, i) : nullptr);
    mine.stages.push_back(add(wiring.stages[r][k], ctx->stage_name(r, k)));
  }
  for (int r : plan.loader_replicas) {
    mine.loader_replicas.push_back(r);
    wiring.loaders[r] = spawn_data_loader_actor(self, ctx, s.wiring, r);
    mine.loaders.push_back(add(wiring.loaders[r], ctx->loader_name(r)));
  }
  spdlog::debug("supervisor of node {}: spawned {} actors", plan.node, s.children.size());
  return mine;
}

bool current(const supervisor_state& s, std::int32_t round) { return s.recovering && s.recovering->round == round; }

/// A simulated node silent now (faults.freeze_node): it answers nothing until it is lost.
bool silent(const supervisor_state& s) { return s.ctx->simulated && s.ctx->simulated->groups->silent(s.plan.node); }

/// Ends a simulated node's silence (it is lost: its replacement speaks).
void end_silence(const supervisor_state& s) {
  if (s.ctx->simulated) s.ctx->simulated->groups->silence(s.plan.node, false);
}

supervisor_actor::behavior_type serving(supervisor_self self);
supervisor_actor::behavior_type recovering(supervisor_self self);

/// Switches to the behavior of the phase `recovering` says (the diagram in
/// supervisor_actor.hpp): serving, or recovering (a retry in place, or a rejoin).
void enter_phase(supervisor_self self) {
  auto& s = self->state;
  if (s.recovering)
    spdlog::debug("supervisor of node {}: recovering (round {}, step {})", s.plan.node, s.recovering->round,
                  s.recovering->step + 1);
  else
    spdlog::debug("supervisor of node {}: serving", s.plan.node);
  self->become(s.recovering ? recovering(self) : serving(self));
}

/// Ends the recovery under way with the error `why`.
void give_up(supervisor_self self, const std::string& why) {
  auto& s = self->state;
  if (!s.recovering) return;
  s.recovering->promise.deliver(
      caf::make_error(caf::sec::runtime_error, "node " + std::to_string(s.plan.node) + ": " + why));
  s.recovering.reset();
  enter_phase(self);
}

void on_gathered(supervisor_self self, std::int32_t round, const std::string& err);

/// Starts the all-gather of every stage's parameters; each completion comes back as
/// (gathered, round, error).
void gather(supervisor_self self) {
  auto& s = self->state;
  auto& rec = *s.recovering;
  if (s.ctx->simulated) {
    // No parameters to gather: the all-gather of each slot's stage from its shards'
    // snapshots takes its modelled time (the step's all-gather of the stage's chunks; the
    // slots' all-gathers side by side).
    const auto& sim = *s.ctx->simulated;
    double seconds = 0;
    for (const auto& [r, k] : s.plan.slots) {
      double stage = 0;
      for (int c = 0; c < s.ctx->v; ++c) stage += sim.model.chunks.at(std::size_t(s.ctx->virtual_stage(k, c))).all_gather;
      seconds = std::max(seconds, stage);
    }
    rec.pending = 1;
    self->delayed_send(self, sim.wait(seconds), gathered_atom_v, rec.round, std::string());
    return;
  }
  const auto me = caf::actor_cast<supervisor_actor>(self);
  std::vector<transport::work_ptr> works;
  for (std::size_t i = 0; i < s.plan.slots.size(); ++i) {
    const auto [r, k] = s.plan.slots[i];
    auto snap = s.store->get(k, r, rec.step);
    if (!snap)
      return give_up(self, "no snapshot of shard[stage " + std::to_string(k) + ", rank " + std::to_string(r) +
                               "] before step " + std::to_string(rec.step + 1));
    rec.from.push_back(snap);
    rec.params.emplace_back();
    for (std::size_t c = 0; c < snap->chunks.size(); ++c) {
      // The dense region over the data-parallel group, the experts' over theirs.
      const auto& piece = snap->chunks[c].params;
      const auto n = snap->stage_numel.at(c), split = snap->stage_expert_offset.at(c);
      auto& whole = rec.params.back().emplace_back(torch::empty({n}, piece.options()));
      const auto dense = split / s.ctx->g;
      works.push_back(s.plan.comms.at(i)->all_gather(piece.narrow(0, 0, dense), whole.narrow(0, 0, split)));
      if (split < n)
        works.push_back(s.plan.edp_comms.at(i)->all_gather(piece.narrow(0, dense, piece.numel() - dense),
                                                           whole.narrow(0, split, n - split)));
    }
  }
  rec.pending = int(works.size());  // every node hosts at least one slot
  for (auto& w : works)
    w->on_complete([me, round = rec.round](const std::string& err) { caf::anon_send(me, gathered_atom_v, round, err); });
}

/// Replaces the communicators (the old ones may be in the middle of a collective, with
/// messages of the aborted step on their way), then gathers. The old ones are closed on
/// a thread of their own: closing waits up to seconds for transfers UCX cannot cancel
/// (a send whose receiver was killed).
void renew(supervisor_self self) {
  auto& s = self->state;
  auto& plan = s.plan;
  std::vector<std::shared_ptr<transport::communicator>> old = std::move(plan.comms);
  for (auto* group : {&plan.ep_comms, &plan.ep_backward_comms, &plan.tp_comms, &plan.cp_comms, &plan.edp_comms}) {
    old.insert(old.end(), group->begin(), group->end());
    group->clear();
  }
  if (plan.world) old.push_back(std::move(plan.world));
  plan.comms.clear();
  plan.world = nullptr;
  s.wiring->world = nullptr;
  for (auto& c : old) c->abort("replaced: the step is retried in place");
  s.retired.remove_if([](std::future<void>& f) { return f.wait_for(std::chrono::seconds(0)) == std::future_status::ready; });
  s.retired.push_back(std::async(std::launch::async, [old = std::move(old)]() mutable { old.clear(); }));
  try {
    if (s.ctx->simulated) {  // no communicators; simulated nodes exchange addresses as node processes do
      if (!plan.registrar) return gather(self);
      auto addrs = simulated_addresses(*s.ctx, plan.node, plan.slots);
      const auto round = addrs.round = s.recovering->round;
      self->request(plan.registrar, std::chrono::seconds(60 + s.ctx->cfg.rejoin_timeout), addrs)
          .then(
              [self, round](const node_addresses& table) {
                if (!current(self->state, round)) return;
                spdlog::debug("node {}: {} address entries in round {}", self->state.plan.node, table.stages.size(),
                              round);
                gather(self);
              },
              [self, round](caf::error& err) {
                if (current(self->state, round)) give_up(self, "address exchange: " + self->system().render(err));
              });
      return;
    }
    if (!plan.renew) {  // one process: in-process communicators
      plan = local_node_plan(*s.ctx);
      return gather(self);
    }
    std::shared_ptr<comm_renewal> fresh = plan.renew();
    auto addrs = fresh->addresses();
    const auto round = addrs.round = s.recovering->round;
    // Every node's addresses of this round: a node process that rejoins may take a while.
    const auto wait = std::chrono::seconds(60 + s.ctx->cfg.rejoin_timeout);
    self->request(plan.registrar, wait, addrs)
        .then(
            [self, fresh, round](const node_addresses& table) {
              auto& s = self->state;
              if (!current(s, round)) return;
              try {
                auto next = fresh->connect(table);
                next.registrar = s.plan.registrar;
                next.renew = s.plan.renew;
                s.plan = std::move(next);
                s.wiring->world = s.plan.world;
              } catch (const std::exception& e) {
                return give_up(self, std::string("fresh communicators: ") + e.what());
              }
              gather(self);
            },
            [self, round](caf::error& err) {
              if (current(self->state, round)) give_up(self, "address exchange: " + self->system().render(err));
            });
  } catch (const std::exception& e) {
    give_up(self, std::string("fresh communicators: ") + e.what());
  }
}

/// Stage actors waiting in an expert-parallel all-to-all or a tensor-parallel collective
/// hold their threads (and read no messages) until a peer joins it: a step given up, or
/// retried in place, fails those collectives first, so that the actors can take their
/// exit or abort.
void release_groups(supervisor_state& s, const std::string& why) {
  for (auto* group : {&s.plan.ep_comms, &s.plan.ep_backward_comms, &s.plan.tp_comms, &s.plan.cp_comms})
    for (auto& c : *group)
      if (c) c->abort(why);
  // (Gradients or parameters sharded: the stages' ops wait in the shards' communicators.)
  if (s.ctx->shards_grads())
    for (auto* group : {&s.plan.comms, &s.plan.edp_comms})
      for (auto& c : *group)
        if (c) c->abort(why);
}

/// The name of the child that `msg` says is gone; it leaves the list.
std::string erase_child(supervisor_state& s, const caf::down_msg& msg) {
  for (auto it = s.children.begin(); it != s.children.end(); ++it)
    if (it->first.address() == msg.source) {
      auto name = std::move(it->second);
      s.children.erase(it);
      return name;
    }
  return "unknown actor";
}

/// Serving: a child that died is reported to the coordinator.
void on_child_down(supervisor_self self, const caf::down_msg& msg) {
  auto& s = self->state;
  const auto name = erase_child(s, msg);
  if (msg.reason == caf::exit_reason::user_shutdown || msg.reason == caf::exit_reason::normal) return;
  if (s.wiring->coordinator)
    self->send(s.wiring->coordinator,
               runtime_failure{-1, name, "actor died: " + self->system().render(msg.reason), s.wiring->generation});
}

/// Recovering: the children were told to go; after the last, fresh communicators.
void on_killed_child_down(supervisor_self self, const caf::down_msg& msg) {
  auto& s = self->state;
  erase_child(s, msg);
  if (s.children.empty()) renew(self);
}

/// Starts recovery `round` (a newer one replaces one under way: a node was lost during
/// it); nothing when `round` is not newer than the one under way (stale_round).
std::optional<caf::typed_response_promise<node_actors>> start_recovery(supervisor_self self, std::int64_t step,
                                                                       std::int32_t round) {
  auto& s = self->state;
  if (s.recovering) {
    if (s.recovering->round >= round) return std::nullopt;
    give_up(self, "recovery round " + std::to_string(s.recovering->round) + " replaced by round " + std::to_string(round));
  }
  auto rp = self->make_response_promise<node_actors>();
  s.recovering = recovery{step, round, rp, {}, {}, 0, {}};
  enter_phase(self);
  return rp;
}

caf::error stale_round(std::int32_t round) {
  return caf::make_error(caf::sec::runtime_error, "recovery round " + std::to_string(round) + " is not the newest");
}

/// This node process was lost and restarted: its shards' state before `step` comes from
/// `buddy` (the next node's supervisor), then the recovery goes on as a retry's.
caf::result<node_actors> recover_from_buddy(supervisor_self self, std::int64_t step, std::int32_t round,
                                            const caf::actor& buddy) {
  auto& s = self->state;
  if (!s.children.empty()) return caf::make_error(caf::sec::runtime_error, std::string("not a rejoined node"));
  auto rp = start_recovery(self, step, round);
  if (!rp) return stale_round(round);
  self->request(caf::actor_cast<supervisor_actor>(buddy), std::chrono::seconds(60), buddy_atom_v, step)
      .then(
          [self, step, round](const std::vector<shard_copy>& copies) {
            auto& s = self->state;
            if (!current(s, round)) return;
            try {
              for (const auto& c : copies) s.store->put(c.stage, c.rank, snapshot_of(c));
            } catch (const std::exception& e) {
              return give_up(self, std::string("copies from the buddy node: ") + e.what());
            }
            spdlog::info("node {}: state of {} optimizer shard(s) before step {} taken from the buddy node", s.plan.node,
                         copies.size(), step + 1);
            renew(self);
          },
          [self, round](caf::error& err) {
            if (current(self->state, round)) give_up(self, "copies from the buddy node: " + self->system().render(err));
          });
  return *rp;
}

/// A buddy copy of a shard of the previous node: its tensors come over the nodes' world
/// communicator (UCX); once all are in (copied_atom), the copy is kept and acknowledged.
caf::result<bool> receive_copy(supervisor_self self, shard_copy& copy) {
  auto& s = self->state;
  auto in = std::make_shared<incoming_copy>();
  in->copy = std::move(copy);
  std::vector<tensor_payload*> remote;
  for (auto* v : {&in->copy.params, &in->copy.exp_avg, &in->copy.exp_avg_sq})
    for (auto& p : *v)
      if (p.src_node >= 0) remote.push_back(&p);
  if (!remote.empty() && !s.wiring->world)
    return caf::make_error(caf::sec::runtime_error, std::string("no world communicator for a shard copy"));
  const auto id = ++s.next_copy;
  in->promise = self->make_response_promise<bool>();
  in->left = int(remote.size()) + 1;
  s.incoming[id] = in;
  const auto me = caf::actor_cast<supervisor_actor>(self);
  auto arrived = [in, me, id] {
    if (--in->left == 0) caf::anon_send(me, copied_atom_v, id);
  };
  for (auto* p : remote)
    // Kept in host memory; from a GPU job's shards (CUDA IPC on one machine, staged
    // otherwise) into page-locked memory, reused from step to step by LibTorch's
    // caching host allocator: the shard's step waits for this copy.
    fetch_payload(*s.wiring, *p, [in, p, arrived](tensor_payload got, const std::string& err) {
      {
        std::lock_guard<std::mutex> lock(in->m);
        if (!err.empty()) in->error = err;
        else *p = std::move(got);
      }
      arrived();
    }, torch::kCPU, /*pinned=*/s.ctx->device.is_cuda());
  arrived();
  return in->promise;
}

/// Every tensor of copy `id` is in: kept (the two newest of each shard), acknowledged.
void copy_arrived(supervisor_self self, std::uint64_t id) {
  auto& s = self->state;
  auto it = s.incoming.find(id);
  if (it == s.incoming.end()) return;
  auto in = it->second;
  s.incoming.erase(it);
  std::lock_guard<std::mutex> lock(in->m);
  try {
    if (!in->error.empty()) throw std::runtime_error("shard copy: " + in->error);
    s.buddies->put(in->copy.stage, in->copy.rank, snapshot_of(in->copy));
    in->promise.deliver(true);
  } catch (const std::exception& e) {
    in->promise.deliver(caf::make_error(caf::sec::runtime_error, e.what()));
  }
}

/// One all-gather of a recovery finished; after the last, the new actors start.
void on_gathered(supervisor_self self, std::int32_t round, const std::string& err) {
  auto& s = self->state;
  if (!current(s, round)) return;
  auto& rec = *s.recovering;
  if (!err.empty() && rec.error.empty()) rec.error = err;
  if (--rec.pending > 0) return;
  if (!rec.error.empty()) return give_up(self, "gathering the stages' parameters: " + rec.error);
  try {
    s.mine = spawn_all(self, rec.step, rec.round, std::move(rec.params));
  } catch (const std::exception& e) {
    return give_up(self, e.what());
  }
  rec.promise.deliver(s.mine);
  s.recovering.reset();
  enter_phase(self);
}

/// The whole job's handles, before the first step or a retried one (while no actor reads
/// the wiring).
void take_wiring(supervisor_state& s, const wiring_msg& msg) {
  const auto& ctx = *s.ctx;
  auto& wiring = *s.wiring;
  wiring.coordinator = caf::actor_cast<coordinator_actor>(msg.coordinator);
  const int nodes = int(msg.supervisors.size());
  wiring.buddy_node = nodes > 1 && s.plan.node > 0 ? (s.plan.node + 1) % nodes : -1;
  wiring.buddy = wiring.buddy_node >= 0 ? caf::actor_cast<supervisor_actor>(msg.supervisors.at(wiring.buddy_node))
                                        : supervisor_actor();
  wiring.nodes.assign(ctx.pipes, std::vector<int>(ctx.p, 0));
  for (int r = 0; r < ctx.pipes; ++r)
    for (int k = 0; k < ctx.p; ++k) wiring.nodes[r][k] = msg.nodes.at(std::size_t(r) * ctx.p + k);
  for (int r = 0; r < ctx.pipes; ++r) {
    wiring.loaders[r] = caf::actor_cast<loader_actor>(msg.loaders.at(r));
    for (int k = 0; k < ctx.p; ++k) {
      wiring.stages[r][k] = caf::actor_cast<stage_actor>(msg.stages.at(std::size_t(r) * ctx.p + k));
      wiring.shards[k][r] = caf::actor_cast<shard_actor>(msg.shards.at(std::size_t(k) * ctx.pipes + r));
    }
  }
}

/// Resets every child and collects what each still held.
caf::result<std::vector<reset_report>> reset_children(supervisor_self self, const reset_step& msg) {
  auto rp = self->make_response_promise<std::vector<reset_report>>();
  auto reports = std::make_shared<std::vector<reset_report>>();
  std::vector<step_actor> handles;
  auto names = std::make_shared<std::vector<std::string>>();
  for (const auto& [h, n] : self->state.children) {
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
}

// --- the two phases' behaviors: each handles every message of supervisor_actor's
// interface; what the phases share is written once below.

auto spawned(supervisor_self self) {
  return [self](run_atom) { return self->state.mine; };  // spawned: here are the handles
}

/// A step retried in place: the children are killed (renew once the last is down), or,
/// with none (a rejoined node's before its first recovery), renewed at once. A newer round
/// replaces one under way (a node was lost during it).
auto retry_in_place(supervisor_self self) {
  return [self](recover_atom, std::int64_t step, std::int32_t round) -> caf::result<node_actors> {
    auto& s = self->state;
    // (A silent node neither rebuilds nor answers: the round waits until it is lost.)
    if (silent(s)) return self->make_response_promise<node_actors>();
    auto rp = start_recovery(self, step, round);
    if (!rp) return stale_round(round);
    if (s.children.empty()) {
      renew(self);
    } else {
      release_groups(s, "the step is retried in place");
      for (auto& [h, n] : s.children) self->send_exit(h, caf::exit_reason::kill);
    }
    return *rp;
  };
}

auto rejoin(supervisor_self self) {
  return [self](recover_atom, std::int64_t step, std::int32_t round, const caf::actor& buddy) {
    return recover_from_buddy(self, step, round, buddy);
  };
}

auto take_copy(supervisor_self self) {
  return [self](shard_copy& copy) { return receive_copy(self, copy); };
}

auto copy_in(supervisor_self self) {
  return [self](copied_atom, std::uint64_t id) { copy_arrived(self, id); };
}

/// The copies of the previous node's shards before `step`, for that node's restarted process.
auto buddy_copies(supervisor_self self) {
  return [self](buddy_atom, std::int64_t step) -> caf::result<std::vector<shard_copy>> {
    if (silent(self->state)) return self->make_response_promise<std::vector<shard_copy>>();
    std::vector<shard_copy> out;
    for (const auto& [key, snap] : self->state.buddies->all_before(step))
      out.push_back(copy_of(key.first, key.second, *snap));
    return out;
  };
}

auto wiring(supervisor_self self) {
  return [self](const wiring_msg& msg) {
    take_wiring(self->state, msg);
    return true;
  };
}

auto abort(supervisor_self self) {
  return [self](const abort_step& msg) {
    release_groups(self->state, "step " + std::to_string(msg.step + 1) + " aborted: " + msg.reason);
    for (auto& [h, n] : self->state.children) self->send(h, msg);
  };
}

// --- the step's relay: the coordinator's begin_step and clip factor to the children, and
// their reports back in a few batches per step (step_reports), so that the coordinator's
// messages grow with the nodes, not the ranks.

/// Sends the reports held, if any.
void flush_reports(supervisor_self self) {
  auto& r = self->state.relay;
  if (r.pending.empty() || !self->state.wiring->coordinator) return;
  r.pending.step = r.step;
  r.pending.attempt = r.attempt;
  r.pending.node = self->state.plan.node;
  self->send(self->state.wiring->coordinator, std::move(r.pending));
  r.pending = step_reports{};
}

enum class report_kind { loss, partial, stage, shard };

/// A child's report of the step is held: sent on with the others once the node's shards
/// have all sent their gradient-norm partials (the clip factor waits for them), or its
/// stages are all done, or its shards are all done. What comes after its kind is complete
/// (a loss report delayed by an injected fault, a duplicate) goes at once.
void held(supervisor_self self, report_kind kind) {
  auto& s = self->state;
  auto& r = s.relay;
  const auto shards = s.mine.shards.size(), stages = s.mine.stages.size();
  bool complete = false;
  switch (kind) {
    case report_kind::loss: complete = r.stages >= stages; break;  // (its stage's stage_done follows it)
    case report_kind::partial: complete = ++r.partials >= shards * std::size_t(s.ctx->v); break;  // one per chunk
    case report_kind::stage: complete = ++r.stages >= stages; break;
    case report_kind::shard: complete = ++r.shards >= shards; break;
  }
  if (complete) flush_reports(self);
}

template <class Report>
auto relay_report(supervisor_self self, std::vector<Report> step_reports::*list, report_kind kind) {
  return [self, list, kind](Report& msg) {
    auto& s = self->state;
    if (msg.step != s.relay.step) {
      spdlog::debug("supervisor of node {}: a report of step {} dropped (relaying step {})", s.plan.node, msg.step + 1,
                    s.relay.step + 1);
      return;
    }
    (s.relay.pending.*list).push_back(std::move(msg));
    held(self, kind);
  };
}

/// begin_step to every child (shards, stages, then loaders), and the relay's count anew.
auto relay_begin(supervisor_self self) {
  return [self](const begin_step& msg) {
    auto& s = self->state;
    // A simulated node goes silent as the step begins (its stages see the same fault):
    // decided here, before any later request to this supervisor (a retry's) is read.
    if (s.ctx->simulated && s.faults.freezes_node(s.plan.node, msg.step, msg.attempt))
      s.ctx->simulated->groups->silence(s.plan.node, true);
    s.relay = relay_state{};
    s.relay.step = msg.step;
    s.relay.attempt = msg.attempt;
    for (const auto* group : {&s.mine.shards, &s.mine.stages, &s.mine.loaders})
      for (const auto& a : *group) self->send(caf::actor_cast<step_actor>(a), msg);
  };
}

/// The clip factor to every shard of this node.
auto relay_clip(supervisor_self self) {
  return [self](const clip_factor_msg& msg) {
    auto& s = self->state;
    if (msg.step != s.relay.step) return;
    for (const auto& a : s.mine.shards) self->send(caf::actor_cast<shard_actor>(a), msg);
  };
}

/// The hang diagnosis: what this process's threads compute in `step` (for the stage
/// actors that cannot answer while inside an op). The reports held go first, so that the
/// coordinator has all that the actors sent before they answered its probe.
auto activity(supervisor_self self) {
  return [self](activity_atom, std::int64_t step) -> caf::result<std::vector<wait_report>> {
    if (silent(self->state)) return self->make_response_promise<std::vector<wait_report>>();
    flush_reports(self);
    return activity_board::reports(self->state.wiring->generation, step);
  };
}

auto plant(supervisor_self self) {
  return [self](plant_atom, int replica, int stage) {
    self->send(self->state.wiring->stages.at(replica).at(stage), plant_atom_v);
  };
}

/// Serving: the children run the job's steps; between steps the reset check; a child
/// that dies is reported.
supervisor_actor::behavior_type serving(supervisor_self self) {
  self->set_down_handler([self](const caf::down_msg& msg) { on_child_down(self, msg); });
  return {
      spawned(self), retry_in_place(self), rejoin(self), take_copy(self), copy_in(self), buddy_copies(self),
      [self](gathered_atom, std::int32_t round, const std::string&) {  // of a recovery given up
        spdlog::debug("supervisor of node {}: an all-gather of recovery round {} dropped", self->state.plan.node, round);
      },
      wiring(self),
      [self](check_atom, const reset_step& msg) -> caf::result<std::vector<reset_report>> {
        if (silent(self->state)) return self->make_response_promise<std::vector<reset_report>>();
        return reset_children(self, msg);
      },
      abort(self), activity(self), plant(self),
      relay_begin(self), relay_clip(self),
      relay_report<loss_report>(self, &step_reports::losses, report_kind::loss),
      relay_report<grad_norm_partial>(self, &step_reports::partials, report_kind::partial),
      relay_report<stage_done>(self, &step_reports::stages, report_kind::stage),
      relay_report<shard_done>(self, &step_reports::shards, report_kind::shard),
  };
}

/// Recovering: a step message, dropped.
template <class Msg>
auto stale(supervisor_self self, const char* what) {
  return [self, what](const Msg& msg) {
    spdlog::debug("supervisor of node {} (recovering): {} of step {} dropped", self->state.plan.node, what, msg.step + 1);
  };
}

/// Recovering: the children are killed, the communicators renewed, the stages'
/// parameters gathered, then new children spawned (on_gathered), and back to serving.
supervisor_actor::behavior_type recovering(supervisor_self self) {
  self->set_down_handler([self](const caf::down_msg& msg) { on_killed_child_down(self, msg); });
  return {
      spawned(self), retry_in_place(self), rejoin(self), take_copy(self), copy_in(self), buddy_copies(self),
      [self](gathered_atom, std::int32_t round, const std::string& err) { on_gathered(self, round, err); },
      wiring(self),
      [self](check_atom, const reset_step&) -> caf::result<std::vector<reset_report>> {
        return caf::make_error(caf::sec::runtime_error,
                               "node " + std::to_string(self->state.plan.node) + " is recovering: no step to reset");
      },
      abort(self), activity(self), plant(self),
      // (No step runs: what the old children sent, or a begin, is stale.)
      stale<begin_step>(self, "begin"), stale<clip_factor_msg>(self, "clip factor"),
      stale<loss_report>(self, "loss report"), stale<grad_norm_partial>(self, "gradient-norm partial"),
      stale<stage_done>(self, "stage-done report"), stale<shard_done>(self, "shard-done report"),
  };
}

supervisor_actor::behavior_type supervisor_behavior(supervisor_self self, std::shared_ptr<const runtime_context> ctx,
                                  std::shared_ptr<job_wiring> wiring, node_plan initial_plan) {
  auto& s = self->state;
  s.ctx = ctx;
  s.wiring = wiring;
  s.plan = std::move(initial_plan);
  // The wiring covers the whole job; entries of other nodes arrive with wiring_msg.
  wiring->stages.assign(ctx->pipes, std::vector<stage_actor>(ctx->p));
  wiring->shards.assign(ctx->p, std::vector<shard_actor>(ctx->pipes));
  wiring->loaders.assign(ctx->pipes, loader_actor());
  wiring->node = s.plan.node;
  wiring->world = s.plan.world;
  wiring->supervisor = caf::actor_cast<supervisor_actor>(self);  // (cleared as it quits: no cycle)
  // A node process restarted after a loss starts without actors: the coordinator's
  // recover (with the buddy that holds its shards' state) spawns them.
  s.mine.node = s.plan.node;
  if (!s.plan.rejoining) s.mine = spawn_all(self, -1, 0, {});
  s.faults = fault_injector(ctx->faults);
  self->set_exit_handler([self](const caf::exit_msg& msg) {
    end_silence(self->state);
    release_groups(self->state, "the node is shutting down");
    self->state.wiring->supervisor = nullptr;
    for (auto& [h, n] : self->state.children) self->send_exit(h, msg.reason);
    self->quit(msg.reason);
  });
  // (The state, the children's handles with it, goes when the actor quits: a remote
  // node's proxy may keep this actor's object alive after it is gone, and a detached
  // stage actor that a handle still named would never be destroyed, the actor system
  // waiting for it forever.)
  return serving(self);
}

}  // namespace

supervisor_actor spawn_supervisor_actor(caf::actor_system& sys, std::shared_ptr<const runtime_context> ctx,
                                        std::shared_ptr<job_wiring> wiring, node_plan plan) {
  return sys.spawn(supervisor_behavior, std::move(ctx), std::move(wiring), std::move(plan));
}

}  // namespace troupe
