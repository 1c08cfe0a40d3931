#include "actors/node.hpp"

#include "actors/compute_gate.hpp"

#include "actors/checkpoint_writer.hpp"
#include "actors/intra_op_threads.hpp"
#include "compute/checkpoint/checkpoint_dir.hpp"
#include "compute/runtime/device.hpp"
#include "compute/runtime/kernel_profile.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <numeric>
#include <set>
#include <thread>

#include <caf/all.hpp>
#include <caf/io/all.hpp>
#include <caf/openssl/all.hpp>
#include <torch/torch.h>

#include "actors/clock_probe_actor.hpp"
#include "actors/coordinator/coordinator.hpp"
#include "actors/node_transport.hpp"
#include "actors/registrar_actor.hpp"
#include "actors/supervisor_actor.hpp"
#include "actors/trace.hpp"
#include "compute/trainer/local_trainer.hpp"
#include "messages/type_ids.hpp"
#include "transport/host_staging.hpp"
#include "transport/ipc/ipc.hpp"
#include "transport/nccl/nccl_communicator.hpp"
#include "transport/ordered_p2p.hpp"
#include "transport/ucx/ucx_communicator.hpp"

namespace troupe {

namespace {

using namespace std::chrono_literals;

std::string hostname() {
  char buf[256] = {0};
  ::gethostname(buf, sizeof buf - 1);
  return buf;
}

struct node_failure : std::runtime_error {
  node_failure(int code, const std::string& what) : std::runtime_error(what), code(code) {}
  int code;
};

/// Blocking request from the node's main thread.
template <class Reply, class Handle, class Msg>
Reply ask(caf::scoped_actor& self, const Handle& dest, std::chrono::milliseconds timeout, Msg&& msg,
          const std::string& what, int code = 1) {
  Reply out{};
  bool ok = false;
  std::string err;
  self->request(dest, timeout, std::forward<Msg>(msg))
      .receive(
          [&](Reply& r) {
            out = std::move(r);
            ok = true;
          },
          [&](caf::error& e) { err = self->system().render(e); });
  if (!ok) throw node_failure(code, what + ": " + err);
  return out;
}

bool use_tls(const node_options& o) { return !o.tls_certificate.empty(); }

/// A node other than node 0 reads the job's data here as node 0 did (the data loaders of
/// the replicas whose first stage it hosts read it): data that is missing, or not node
/// 0's (other files: its replicas would train on other samples than the job's), ends this
/// node with status 1 (and tell_node_zero_unfit tells the registrar: the job does not
/// start, node 0 says why).
void check_node_data(const job_config& cfg, const job_offer& offer, const std::string& where) {
  std::string reason;
  try {
    const auto mine = training_data::identity(cfg);
    if (mine != offer.data)
      reason = "its data (" + mine + ") is not node 0's (" + offer.data + "): every node must read the same";
  } catch (const data_error& e) {
    reason = e.what();
  }
  if (!reason.empty()) throw node_failure(1, where + " on " + hostname() + " cannot run this job: " + reason);
}

/// A node other than node 0 that joined and then failed before it was ready (its data,
/// the job's config, its transports): tells the registrar (node_unfit), so the job ends
/// at once with the reason on node 0 rather than after node 0's join timeout.
void tell_node_zero_unfit(caf::actor_system& sys, const registrar_actor& registrar, const node_options& o,
                          const std::string& error) {
  const std::string where = "node " + std::to_string(o.node);
  std::string reason = error;
  const auto prefix = where + " on " + hostname() + " cannot run this job: ";
  if (reason.rfind(prefix, 0) == 0) reason = reason.substr(prefix.size());
  else if (reason.rfind(where + ": ", 0) == 0) reason = reason.substr(where.size() + 2);
  try {
    caf::scoped_actor self{sys};
    ask<bool>(self, registrar, std::chrono::milliseconds(5000), node_unfit{o.node, hostname(), reason},
              where + ": telling node 0");
  } catch (const std::exception& e) {
    spdlog::warn("{}", e.what());
  }
}

/// The job's timeline on this node (job_clock): node 0's machine shares node 0's steady
/// clock; a node on another machine measures the offset to it by 8 round trips to the
/// registrar now (clock_probe_keeper follows it from there). Tests pretend another machine
/// whose clock is `o.clock_skew_ns` ahead and runs `o.clock_drift_ppm` fast.
std::shared_ptr<job_clock> node_job_clock(caf::scoped_actor& self, const registrar_actor& registrar,
                                          const job_offer& offer, const node_options& o, const std::string& where) {
  const bool pretend = o.clock_skew_ns != 0 || o.clock_drift_ppm != 0;
  if (o.node == 0 || (offer.machine == transport::machine_key() && !pretend))
    return std::make_shared<job_clock>(offer.epoch_ns);
  auto clock = std::make_shared<job_clock>(offer.epoch_ns, o.clock_skew_ns, o.clock_drift_ppm);
  std::vector<clock_sample> samples;
  for (int i = 0; i < 8; ++i) {
    clock_sample c;
    c.sent_ns = clock->local_ns();
    c.remote_ns = ask<std::int64_t>(self, registrar, o.join_timeout, clock_atom_v, where + ": clock probe", 3);
    c.received_ns = clock->local_ns();
    samples.push_back(c);
  }
  std::int64_t round_trip = 0;
  const auto offset = clock->add_probe(samples, &round_trip);
  spdlog::info("{}: another machine than node 0's: its clock is {:+.3f} ms from node 0's (trace and bubble on node "
               "0's timeline; best of 8 round trips {:.3f} ms{})",
               where, offset * 1e-6, round_trip * 1e-6,
               o.clock_probe_interval.count() > 0
                   ? fmt::format("; probed again, up to every {:.3g} s", o.clock_probe_interval.count() * 1e-3)
                   : std::string());
  return clock;
}

registrar_actor connect_to_registrar(caf::actor_system& sys, const node_options& o) {
  const auto deadline = std::chrono::steady_clock::now() + o.join_timeout;
  std::string last;
  while (std::chrono::steady_clock::now() < deadline) {
    // Typed: the registrar's interface is checked as the connection opens.
    auto r = use_tls(o) ? caf::openssl::remote_actor<registrar_actor>(sys, o.host, o.port)
                        : sys.middleman().remote_actor<registrar_actor>(o.host, o.port);
    if (r) return *r;
    if (r.error() == caf::sec::unexpected_actor_messaging_interface)  // waiting will not help
      throw node_failure(1, "node " + std::to_string(o.node) + ": the coordinator at " + o.host + ":" +
                                std::to_string(o.port) + " speaks another protocol (another Troupe build?)");
    last = sys.render(r.error());
    std::this_thread::sleep_for(200ms);
  }
  // A rejoining node reached node 0 before: node 0 is frozen, cut off or gone (the
  // launcher ends it). A first join that fails may be this node's own fault (TLS, a port).
  throw node_failure(o.rejoin ? exit_coordinator_unreachable : 1,
                     "node " + std::to_string(o.node) + ": cannot reach the coordinator at " + o.host + ":" +
                            std::to_string(o.port) + " within " + std::to_string(o.join_timeout.count() / 1000) +
                            " s (" + last + ")");
}

}  // namespace

namespace {
/// The node hosting slot (pipeline q, stage k) in node_slots' layout (which it checked).
int node_of_slot(int p, int d, int nodes, int t, int q, int k) {
  const int per = p * d * t / nodes;
  return ((q / t) * t * p + k * t + q % t) / per;
}
}  // namespace

std::vector<std::pair<int, int>> link_pairs(int p, int d, int nodes, int t) {
  node_slots(p, d, 0, nodes, t);  // (the layout's check)
  std::set<std::pair<int, int>> pairs;
  auto node_of = [&](int q, int k) { return node_of_slot(p, d, nodes, t, q, k); };
  auto both_ways = [&](int a, int b) {
    if (a == b) return;
    pairs.emplace(a, b);
    pairs.emplace(b, a);
  };
  for (int q = 0; q < d * t; ++q) {
    for (int k = 0; k + 1 < p; ++k) both_ways(node_of(q, k), node_of(q, k + 1));
    both_ways(node_of(q, 0), node_of(q, p - 1));
  }
  return {pairs.begin(), pairs.end()};
}

std::vector<std::int32_t> world_peers(int p, int d, int nodes, int t, int node) {
  std::set<std::int32_t> peers;
  auto add = [&](int other) {
    if (other != node) peers.insert(other);
  };
  for (const auto& [q, k] : node_slots(p, d, node, nodes, t)) {
    if (k > 0) add(node_of_slot(p, d, nodes, t, q, k - 1));
    if (k + 1 < p) add(node_of_slot(p, d, nodes, t, q, k + 1));
    if (k == 0) add(node_of_slot(p, d, nodes, t, q, p - 1));
    if (k == p - 1) add(node_of_slot(p, d, nodes, t, q, 0));
  }
  // The buddy copies: the shards of node n > 0 send theirs to node n + 1 mod N (node 0's
  // keep none: its loss ends the job). They come back at a rejoin over CAF, not the world.
  if (nodes > 1 && node > 0) add((node + 1) % nodes);
  if (nodes > 1 && (node + nodes - 1) % nodes > 0) add((node + nodes - 1) % nodes);
  return {peers.begin(), peers.end()};
}

std::string nccl_refusal(const std::vector<std::string>& member_gpus) {
  if (member_gpus.size() < 2) return "a group of one rank";
  std::string absent;
  for (std::size_t r = 0; r < member_gpus.size(); ++r)
    if (member_gpus[r].empty()) absent += (absent.empty() ? "" : ", ") + std::to_string(r);
  if (!absent.empty()) return "rank(s) " + absent + " did not ask for NCCL or have no GPU for it";
  for (std::size_t a = 0; a < member_gpus.size(); ++a)
    for (std::size_t b = a + 1; b < member_gpus.size(); ++b)
      if (member_gpus[a] == member_gpus[b])
        return "ranks " + std::to_string(a) + " and " + std::to_string(b) + " share a GPU (" + member_gpus[a] +
               "), and NCCL puts one rank per GPU";
  return "";
}

int assign_nccl_ids(node_addresses& table, const std::function<std::string()>& make_id) {
  const auto n = std::min({table.stages.size(), table.replicas.size(), table.gpus.size()});
  table.nccl_ids.resize(table.stages.size());
  // Per group (a shard group >= 0, the world -1, a tensor-parallel group spread over
  // nodes <= tensor_group_base, an expert group or an expert shard group): its members'
  // GPU keys by rank. (Not the context-parallel groups spread over nodes: UCX.)
  auto is_group = [](int stage) {
    return stage >= 0 || (stage <= tensor_group_base && stage > context_group_base) || is_expert_shard_entry(stage) ||
           is_expert_group_entry(stage);
  };
  std::map<int, std::vector<std::string>> keys;
  for (std::size_t i = 0; i < n; ++i)
    if ((is_group(table.stages[i]) || table.stages[i] == -1) && table.replicas[i] >= 0) {
      auto& column = keys[table.stages[i]];
      if (int(column.size()) <= table.replicas[i]) column.resize(table.replicas[i] + 1);
      column[table.replicas[i]] = table.gpus[i];
    }
  const auto& world = keys[-1];
  auto world_key = [&](int node) { return node >= 0 && node < int(world.size()) ? world[node] : std::string(); };
  int given = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const int stage = table.stages[i], rank = table.replicas[i];
    std::string refusal;
    if (is_group(stage) && rank == 0)
      refusal = nccl_refusal(keys[stage]);
    else if (stage <= -2 && stage > expert_group_base)
      refusal = nccl_refusal({world_key(-2 - stage), world_key(rank)});
    else
      continue;  // no id: the world, and a shard group's other ranks
    if (!refusal.empty()) continue;
    table.nccl_ids[i] = make_id();
    if (!table.nccl_ids[i].empty()) ++given;
  }
  return given;
}

namespace {

/// The actor system of a node process: the middleman (with TLS where asked for), the
/// message types, failure detection on.
void configure_node_system(caf::actor_system_config& acfg, const node_options& o) {
  acfg.load<caf::io::middleman>();
  acfg.add_message_types<caf::id_block::troupe>();
  acfg.set("scheduler.policy", caf::atom("sharing"));
  acfg.set("scheduler.max-threads", std::size_t{2});
  acfg.add_thread_hook<one_intra_op_thread>();  // (see runtime.cpp)
  // CAF's failure detection is off by default: a frozen or vanished node must be noticed.
  acfg.set("middleman.heartbeat-interval", caf::timespan{o.heartbeat});
  acfg.set("middleman.connection-timeout", caf::timespan{o.connection_timeout});
  if (use_tls(o)) {
    for (const auto* path : {&o.tls_certificate, &o.tls_key, &o.tls_cafile})
      if (path->empty() || ::access(path->c_str(), R_OK) != 0)
        throw config_error("TLS needs a readable certificate, key and CA file (got '" + *path + "')");
    acfg.load<caf::openssl::manager>();
    acfg.openssl_certificate = o.tls_certificate;
    acfg.openssl_key = o.tls_key;
    acfg.openssl_cafile = o.tls_cafile;
  }
}

/// Node 0: checks the job (`cfg`, its own configuration, resolved) and publishes the
/// registrar the other nodes join.
registrar_actor open_registrar(caf::actor_system& sys, const node_options& o, job_config& cfg) {
  cfg = o.cfg;
  cfg.validate();
  if (cfg.compute == "simulated")
    throw config_error("invalid configuration: compute simulated runs in one process (build/troupe train, or "
                       "launch/troupe train --nodes 1), not yet over node processes");
  job_slots(cfg, 0, o.nodes);  // fits, or a clear error now
  // (And checkpoint_dir locked for this job before anything in it is read; a restart
  // waits a little for its previous launch's node 0 to let go of it.)
  check_output_paths(cfg, o.run.launch.attempt > 0 ? 30 : 0);
  resolve_resume(cfg, o.run.launch.resume_auto);  // one checkpoint folder for every node (they get this config)
  if (report_complete_run(cfg)) throw node_failure(0, "the run is already complete");  // (a clean end, status 0)
  const auto data = training_data::identity(cfg);  // the data every node must read
  check_kernel_profile(o.run.launch.kernel_profile);
  auto registrar = spawn_registrar(sys, o.token, o.nodes, cfg.to_toml(), steady_clock_ns(), data);
  auto port = use_tls(o) ? caf::openssl::publish(registrar, o.port, nullptr, true)
                         : sys.middleman().publish(registrar, o.port, nullptr, true);
  if (!port)
    throw node_failure(1, "node 0: cannot listen on port " + std::to_string(o.port) + ": " + sys.render(port.error()));
  spdlog::info("node 0 of {}: coordinator listening on port {}{}", o.nodes, *port, use_tls(o) ? " (TLS)" : "");
  return registrar;
}

/// Node 0, once every node is ready: runs the coordinator until the job ends, then waits
/// for every supervisor to stop (so the other nodes get the word before this process
/// closes its connections).
void lead_job(caf::scoped_actor& self, const node_options& o, const job_config& cfg,
              std::shared_ptr<const runtime_context> ctx, std::shared_ptr<job_wiring> wiring,
              std::shared_ptr<actor_run_result> shared_result, const registrar_actor& registrar) {
  auto& sys = self->system();
  const auto supervisors = typed_handles<supervisor_actor>(
      ask<std::vector<caf::actor>>(self, registrar, o.join_timeout, run_atom_v, "node 0: waiting for the other nodes"));
  if (!o.run.quiet)
    spdlog::info("training {}{} for {} steps on {} nodes: {}pipeline {} x data-parallel {}, {} micro-batches of {} "
                 "({}), {} intra-op thread(s) per stage{}",
                 cfg.model_label(), cfg.data_label(), cfg.steps, o.nodes, cfg.model_parallel_label(), cfg.pipeline,
                 cfg.data_parallel, cfg.microbatches, cfg.microbatch_size(), cfg.schedule_label(), cfg.threads,
                 cfg.compute_note());
  auto run_opts = o.run;
  if (run_opts.trace_path.empty()) run_opts.trace_path = cfg.trace;
  auto coordinator = spawn_coordinator_actor(sys, ctx, wiring, run_opts, shared_result, supervisors, registrar);
  self->request(coordinator, caf::infinite, run_atom_v)
      .receive([&](int code) { shared_result->exit_code = code; },
               [&](caf::error& err) {
                 shared_result->exit_code = 1;
                 if (shared_result->error.empty()) shared_result->error = "coordinator failed: " + sys.render(err);
               });
  // The coordinator told every supervisor to stop: wait until they have. The registrar
  // knows the current ones (a rejoined node's replaces the lost one's); a node lost for
  // good leaves its old, dead one (its down comes at once).
  auto current = plain_handles(supervisors);
  self->request(registrar, 1s, run_atom_v)
      .receive([&](std::vector<caf::actor>& now) { current = std::move(now); }, [](caf::error&) {});
  for (auto& sup : current) self->monitor(sup);
  std::size_t down = 0;
  bool waiting = true;
  while (waiting && down < current.size())
    self->receive([&](const caf::down_msg&) { ++down; }, caf::after(10s) >> [&] { waiting = false; });
}

/// Nodes other than 0: serve until the coordinator stops our supervisor, or node 0 is
/// gone. Ending any other way, the process ends with the recoverable status: the launcher
/// starts it again, and it rejoins the job if node 0 is still there (a link that was cut
/// for a while, node 0 stalled past the connection timeout); if node 0 is gone for good,
/// the launcher restarts the whole job anyway.
void serve_job(caf::scoped_actor& self, const std::string& where, const supervisor_actor& supervisor,
               const registrar_actor& registrar, actor_run_result& result) {
  auto& sys = self->system();
  self->monitor(supervisor);
  self->monitor(registrar);
  bool running = true;
  while (running) {
    self->receive([&](const caf::down_msg& msg) {
      if (msg.source == supervisor.address()) {
        running = false;
        const bool clean = msg.reason == caf::exit_reason::user_shutdown;
        result.exit_code = clean ? 0 : exit_recoverable;
        if (!clean) result.error = where + ": supervisor stopped: " + sys.render(msg.reason);
      } else {
        // Node 0 gone: a clean end reaches our supervisor first; give it a moment.
        self->receive([&](const caf::down_msg& m2) {
          if (m2.source == supervisor.address() && m2.reason == caf::exit_reason::user_shutdown) running = false;
        }, caf::after(2s) >> [] {});
        if (running) {
          running = false;
          result.exit_code = exit_recoverable;
          result.error = where + ": lost the coordinator (node 0): " + sys.render(msg.reason);
          self->send_exit(supervisor, caf::exit_reason::user_shutdown);
        }
      }
    });
  }
}

}  // namespace

actor_run_result run_node(const node_options& o) {
  actor_run_result result;
  const int caller_threads = torch::get_num_threads();
  torch::set_num_threads(1);  // only stage actors use intra-op threads (see runtime.cpp)
  struct restore_threads {
    int n;
    ~restore_threads() { torch::set_num_threads(n); }
  } restore{caller_threads};
  auto wiring = std::make_shared<job_wiring>();
  auto shared_result = std::make_shared<actor_run_result>();
  {
    caf::actor_system_config acfg;
    configure_node_system(acfg, o);
    caf::actor_system sys{acfg};
    registrar_actor registrar_handle;
    supervisor_actor supervisor;
    clock_probe_actor clock_keeper;
    bool joined = false;  // a node other than 0 between its join and its node_ready
    try {
      {
        caf::scoped_actor self{sys};
        job_config cfg;
        registrar_handle = o.node == 0 ? open_registrar(sys, o, cfg) : connect_to_registrar(sys, o);
        const std::string where = "node " + std::to_string(o.node);
        const auto offer = ask<job_offer>(self, registrar_handle, o.join_timeout,
                                           node_hello{o.version ? o.version : protocol_version, o.token, o.node,
                                                      o.nodes, hostname(), o.rejoin, transport::machine_key(),
                                                      std::int32_t(::getpid())},
                                           where, 3);
        if (o.node != 0) {
          joined = true;  // from here a failure before node_ready is told to node 0
          cfg = job_config_from_toml(offer.config_toml, "the coordinator's job config");
          check_node_data(cfg, offer, where);
        }
        if (o.rejoin) {
          cfg.fault_attempt = -1;  // the faults of this launch were the old process's
          // Its state comes from the buddy copies and the shards, not from the checkpoint
          // the job started from (which keep_checkpoints may have removed by now).
          cfg.resume.clear();
          cfg.load.clear();
        }
        const auto slots = job_slots(cfg, o.node, o.nodes);
        // threads = 0: share the machine's cores between the stage actors of every node on
        // it (more OpenMP threads than cores, in several processes, spin against each other).
        set_compute_slots(compute_slots_for(cfg, int(slots.size()), std::max(1, o.nodes_per_host)));
        if (cfg.threads == 0)
          cfg.threads = std::max(1, int(std::thread::hardware_concurrency()) /
                                        (int(slots.size()) * std::max(1, o.nodes_per_host)));
        // One timeline for the trace and the measured bubble: node 0's clock from the
        // coordinator's start (node_job_clock).
        const auto clock = node_job_clock(self, registrar_handle, offer, o, where);
        if (clock->probes() > 0 && o.clock_probe_interval.count() > 0)
          clock_keeper = spawn_clock_probe(sys, registrar_handle, clock, o.clock_probe_interval);
        if (cfg.device == "cuda") {  // one GPU per node process of this machine, while there are enough
          const int gpus = cuda_device_count();
          cfg.device = node_device(cfg.device, o.local_node, gpus);
          spdlog::info("{}: computes on {}{} (this machine has {} GPU(s))", where, cfg.device,
                       cfg.deterministic ? " with deterministic algorithms" : "", gpus);
          if (o.nodes_per_host > gpus && gpus > 0 && o.local_node == 0)
            spdlog::warn("{}: {} node processes share this machine's {} GPU(s)", where, o.nodes_per_host, gpus);
        }
        // this node's stages' parameters (and moments), not the whole model's
        std::shared_ptr<const runtime_context> ctx = std::make_shared<runtime_context>(cfg, clock, slots, o.run.launch);
        auto how = transport_for(*ctx, o.transport, where);
        how.host_nodes = std::max(1, o.nodes_per_host);
        node_plan plan;
        if (o.rejoin) {  // communicators come with the coordinator's recovery round
          plan.node = o.node;
          plan.slots = slots;
          plan.rejoining = true;
        } else {  // UCX communicators (round 0 of the address exchange)
          const auto comms =
              make_node_comms(o.node, o.nodes, ctx->p, ctx->d, ctx->t, cfg.expert_parallel, ctx->c, slots, how);
          const auto table = ask<node_addresses>(self, registrar_handle, o.join_timeout, comms->addresses(),
                                                 where + ": address exchange");
          plan = comms->connect(table);
        }
        plan.registrar = registrar_handle;
        plan.renew = [node = o.node, nodes = o.nodes, p = ctx->p, d = ctx->d, t = ctx->t, ep = cfg.expert_parallel,
                      c = ctx->c, slots, how]() -> std::unique_ptr<comm_renewal> {
          return make_node_comms(node, nodes, p, d, t, ep, c, slots, how);
        };
        std::string hosted;  // (replica,stage), with context or tensor parallelism (replica,stage[,cp][,tp])
        for (const auto& [r, k] : slots)
          hosted += " (" + std::to_string(ctx->data_of(r)) + "," + std::to_string(k) +
                    (ctx->c > 1 ? "," + std::to_string(ctx->cp_of(r)) : "") +
                    (ctx->t > 1 ? "," + std::to_string(ctx->tp_of(r)) : "") + ")";
        supervisor = spawn_supervisor_actor(sys, ctx, wiring, std::move(plan));
        ask<bool>(self, registrar_handle, o.join_timeout, node_ready{o.node, caf::actor_cast<caf::actor>(supervisor)},
                  where + ": ready");
        joined = false;
        const std::string here = o.nodes_per_host > 1 ? ", node process " + std::to_string(o.local_node + 1) + " of " +
                                                             std::to_string(o.nodes_per_host) + " on this machine"
                                                       : "";
        spdlog::info("{} on {} (pid {}{}): stages (replica,stage{}){}{}", where, hostname(), ::getpid(), here,
                     std::string(ctx->c > 1 ? ",cp" : "") + (ctx->t > 1 ? ",tp" : ""), hosted,
                     o.rejoin ? ": rejoined the job, waiting for the coordinator's recovery" : "");
        if (o.node == 0) {
          lead_job(self, o, cfg, ctx, wiring, shared_result, registrar_handle);
          result = *shared_result;
        } else {
          serve_job(self, where, supervisor, registrar_handle, result);
          if (clock->probes() > 1)
            spdlog::info("{}: its clock ran {:+.1f} ppm against node 0's ({} probes over {:.0f} s, last offset "
                         "{:+.3f} ms)",
                         where, clock->drift_ppm(), clock->probes(), clock->probed_span_s(),
                         clock->offset_ns(clock->local_ns()) * 1e-6);
        }
      }
    } catch (const config_error& e) {
      result.exit_code = 2;
      result.error = e.what();
      if (supervisor) caf::anon_send_exit(supervisor, caf::exit_reason::user_shutdown);
    } catch (const node_failure& e) {
      result.exit_code = e.code;
      result.error = e.what();
      if (supervisor) caf::anon_send_exit(supervisor, caf::exit_reason::user_shutdown);
    } catch (const std::exception& e) {
      // Node 0 reads the job's input (data, initial weights, the checkpoint it continues
      // from): what is wrong there is bad input. Another node's is its host's failure.
      result.exit_code = o.node == 0 ? exit_code_of(e) : 1;
      result.error = "node " + std::to_string(o.node) + ": " + e.what();
      if (supervisor) caf::anon_send_exit(supervisor, caf::exit_reason::user_shutdown);
    }
    if (joined && result.exit_code != 0 && registrar_handle) tell_node_zero_unfit(sys, registrar_handle, o, result.error);
    if (clock_keeper) caf::anon_send_exit(clock_keeper, caf::exit_reason::user_shutdown);
    clock_keeper = nullptr;
    if (registrar_handle && o.node == 0) caf::anon_send_exit(registrar_handle, caf::exit_reason::user_shutdown);
    registrar_handle = nullptr;
    supervisor = nullptr;
    // A background checkpoint write still running (the run failed meanwhile; its folder is
    // abandoned) finishes before the process ends, not torn by its exit.
    await_checkpoint_writes(checkpoint_write_seconds);
    // The job is over (results and checkpoints written): a shutdown that does not finish
    // (an actor object kept alive by a reference we do not know of) must not keep the
    // process, and with it the launcher, waiting.
    std::thread([code = result.exit_code, node = o.node] {
      std::this_thread::sleep_for(30s);
      spdlog::warn("node {}: shutdown did not finish within 30 s; exiting", node);
      std::_Exit(code);
    }).detach();
    sys.await_all_actors_done();
    wiring->clear();
  }
  return result;
}

}  // namespace troupe
