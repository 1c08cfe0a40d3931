#include "actors/registrar_actor.hpp"

#include <signal.h>

#include <fstream>
#include <map>
#include <set>
#include <vector>

#include <caf/all.hpp>
#include <spdlog/spdlog.h>

#include "actors/node.hpp"
#include "actors/runtime.hpp"
#include "messages/type_ids.hpp"
#include "transport/ipc/ipc.hpp"
#include "transport/nccl/nccl_communicator.hpp"
#include "transport/transport.hpp"

namespace troupe {

namespace {

/// How long a lost node's process that is not stopped may take to end on its own before
/// node 0 ends it.
constexpr auto fence_grace = std::chrono::seconds(5);

struct registrar_state {
  std::string token, config_toml, data;
  std::string unfit;  ///< why a node cannot run the job (node_unfit): the job does not start
  std::int64_t epoch_ns = 0;
  int nodes = 0;
  std::set<int> joined;
  // Address exchanges: round 0 as the nodes join, round n for the n-th in-place recovery.
  std::map<int, address_round> rounds;
  std::vector<caf::actor> supervisors;
  int ready = 0;
  std::vector<caf::response_promise> run_waiters;
  // Nodes whose supervisor is gone: a restarted process may take the place (rejoin).
  std::set<int> lost;
  std::map<int, caf::response_promise> early_rejoins;  // hellos that came before the loss was seen
  std::map<int, std::vector<caf::response_promise>> rejoin_waiters;  // the coordinator's, per node
  // Each node's process as it said in its hello (machine key and pid): node 0 fences a
  // lost node of its own machine.
  std::map<int, std::pair<std::string, std::int32_t>> processes, early_processes;  // (early: of early_rejoins)
};

/// True when process `pid` is node `node` of the job of `token`: its environment holds
/// both (a pid the kernel gave to another process since is left alone).
bool is_node_process(std::int32_t pid, const std::string& token, int node) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/environ", std::ios::binary);
  bool has_token = false, has_node = false;
  for (std::string entry; std::getline(in, entry, '\0');) {
    has_token = has_token || entry == "TROUPE_JOB_TOKEN=" + token;
    has_node = has_node || entry == "TROUPE_NODE=" + std::to_string(node);
  }
  return has_token && has_node;
}

/// The state letter of process `pid` (/proc/PID/stat: R, S, D, T stopped, t traced, Z,
/// ...), or 0 when there is none.
char process_state(std::int32_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  std::getline(in, stat);
  const auto close = stat.rfind(')');  // after "pid (name)"
  return close == std::string::npos || close + 2 >= stat.size() ? 0 : stat[close + 2];
}

/// The process of node `node` as it said in its hello, when it runs on this machine and
/// still is that node's (its environment holds the job's token and the node number: a
/// pid the kernel gave to another process since is left alone); else 0.
std::int32_t live_node_process(const registrar_state& s, int node) {
  const auto it = s.processes.find(node);
  if (it == s.processes.end() || it->second.second <= 0) return 0;
  const auto [machine, pid] = it->second;
  return machine == transport::machine_key() && is_node_process(pid, s.token, node) ? pid : 0;
}

/// Node `node`'s process as it said in its hello when it runs on another machine, else 0.
std::int32_t remote_node_process(const registrar_state& s, int node) {
  const auto it = s.processes.find(node);
  return it != s.processes.end() && it->second.first != transport::machine_key() ? it->second.second : 0;
}

void end_node_process(int node, std::int32_t pid, const char* why) {
  if (::kill(pid, SIGKILL) == 0)
    spdlog::warn("node {} is lost to the job but its process (pid {}) {}: ended it (SIGKILL), so that the launcher "
                 "starts its replacement",
                 node, pid, why);
}

using registrar_self = registrar_actor::stateful_pointer<registrar_state>;

job_offer offer_of(const registrar_state& s) {
  return job_offer{s.config_toml, s.epoch_ns, transport::machine_key(), s.data};
}

void admit_rejoin(registrar_state& s, int node, const std::string& host) {
  s.lost.erase(node);
  s.joined.insert(node);
  spdlog::info("node {} of {} rejoined from {}", node, s.nodes, host);
}

/// A node's supervisor is gone (its process lost): another process may rejoin as it.
void on_supervisor_down(registrar_self self, const caf::down_msg& msg) {
  auto& s = self->state;
  if (msg.reason == caf::exit_reason::user_shutdown) return;  // the job's end
  for (int i = 0; i < s.nodes; ++i) {
    if (!s.supervisors[i] || s.supervisors[i].address() != msg.source) continue;
    s.supervisors[i] = nullptr;
    s.joined.erase(i);
    s.lost.insert(i);
    --s.ready;
    // Fencing: a lost node's process that lives on (stopped, frozen, cut off) keeps its
    // place; on this machine it is ended so that the launcher starts its replacement at
    // once. A stopped one at once; any other after fence_grace (one that lost node 0
    // itself ends on its own meanwhile, with the recoverable status).
    if (const auto pid = live_node_process(s, i)) {
      const char state = process_state(pid);
      if (state == 'T' || state == 't')
        end_node_process(i, pid, "is stopped");
      else
        self->delayed_send(self, fence_grace, check_atom_v, std::int32_t(i), pid);
    } else if (const auto remote = remote_node_process(s, i); remote > 0) {
      // On another machine: launch/troupe, which passes node 0's log on, has that host
      // end it at once (it cannot be seen from here whether it is stopped).
      spdlog::warn("node {} is lost to the job; its process (pid {}) runs on another machine: the launcher ends it "
                   "there if it lives on (fence request: node {} pid {})",
                   i, remote, i, remote);
    }
    if (auto it = s.early_rejoins.find(i); it != s.early_rejoins.end()) {
      s.processes[i] = s.early_processes[i];
      admit_rejoin(s, i, "a process restarted by the launcher");
      it->second.deliver(offer_of(s));
      s.early_rejoins.erase(it);
    }
  }
}

/// A node joins (or a restarted process rejoins as a lost node): the job's offer, or the
/// reason it is refused.
caf::result<job_offer> on_hello(registrar_self self, const node_hello& h) {
  auto& s = self->state;
  std::string why;
  if (h.version != protocol_version)
    why = "protocol version " + std::to_string(h.version) + ", this job speaks " + std::to_string(protocol_version);
  else if (h.token != s.token)
    why = "wrong job token";
  else if (h.nodes != s.nodes || h.node < 0 || h.node >= s.nodes)
    why = "node " + std::to_string(h.node) + " of " + std::to_string(h.nodes) + " does not fit a job of " +
          std::to_string(s.nodes) + " nodes";
  else if (h.rejoin && h.node == 0)
    why = "node 0 cannot rejoin (the coordinator's node)";
  else if (h.rejoin && s.joined.count(h.node) && !s.early_rejoins.count(h.node)) {
    // The old process's connection is not seen closed yet: answer once it is.
    auto rp = self->make_response_promise<job_offer>();
    s.early_rejoins.emplace(h.node, rp);
    s.early_processes[h.node] = {h.machine, h.pid};
    return rp;
  } else if (h.rejoin && !s.lost.count(h.node))
    why = "node " + std::to_string(h.node) + " is not a lost node: it cannot rejoin";
  else if (!h.rejoin && (s.joined.count(h.node) || s.lost.count(h.node)))
    why = "node " + std::to_string(h.node) + " has already joined";
  if (!why.empty()) {
    spdlog::warn("refused a node claiming to be node {} from {}: {}", h.node, h.host, why);
    return caf::make_error(caf::sec::runtime_error, "join refused: " + why);
  }
  s.processes[h.node] = {h.machine, h.pid};
  if (h.rejoin) {
    admit_rejoin(s, h.node, h.host);
  } else {
    s.joined.insert(h.node);
    spdlog::info("node {} of {} joined from {}", h.node, s.nodes, h.host);
  }
  return offer_of(s);
}

/// A node's addresses of round `a.round`: once every node's are in, every node gets its
/// part of the table (table_for; with the NCCL ids of the groups that run over NCCL).
caf::result<node_addresses> on_addresses(registrar_self self, const node_addresses& a) {
  auto& s = self->state;
  if (!s.unfit.empty()) return caf::make_error(caf::sec::runtime_error, s.unfit);
  if (!s.joined.count(a.node)) return caf::make_error(caf::sec::runtime_error, "addresses from a node that has not joined");
  auto& round = s.rounds[a.round];
  auto rp = round.add(self, a);
  if (round.nodes() == s.nodes) {
    assign_nccl_ids(round.table(), [] {
      try {
        const auto bytes = transport::nccl_unique_id();
        return std::string(bytes.begin(), bytes.end());
      } catch (const std::exception& e) {
        spdlog::warn("registrar: no NCCL id (that group or link stays on UCX): {}", e.what());
        return std::string();
      }
    });
    round.deliver();
    s.rounds.erase(a.round);
  }
  return rp;
}

/// A node's supervisor is ready; with every node's, the coordinator may start.
caf::result<bool> on_ready(registrar_self self, const node_ready& r) {
  auto& s = self->state;
  if (!s.joined.count(r.node) || s.supervisors.at(r.node))
    return caf::make_error(caf::sec::runtime_error, "ready from a node that has not joined");
  s.supervisors[r.node] = r.supervisor;
  self->monitor(r.supervisor);
  if (++s.ready == s.nodes) {
    for (auto& w : s.run_waiters) w.deliver(s.supervisors);
    s.run_waiters.clear();
  }
  for (auto& w : s.rejoin_waiters[r.node]) w.deliver(r.supervisor);
  s.rejoin_waiters.erase(r.node);
  return true;
}

/// A node cannot run the job: everyone waiting is told why.
bool on_unfit(registrar_state& s, const node_unfit& u) {
  s.unfit = "node " + std::to_string(u.node) + " on " + u.host + " cannot run this job: " + u.reason;
  spdlog::error("{}", s.unfit);
  const auto why = caf::make_error(caf::sec::runtime_error, s.unfit);
  for (auto& w : s.run_waiters) w.deliver(why);
  s.run_waiters.clear();
  for (auto& [round, r] : s.rounds) r.fail(why);
  s.rounds.clear();
  for (auto& w : s.rejoin_waiters[u.node]) w.deliver(why);
  s.rejoin_waiters.erase(u.node);
  return true;
}

registrar_actor::behavior_type registrar(registrar_self self, std::string token, int nodes,
                                         std::string config_toml, std::int64_t epoch_ns, std::string data) {
  auto& st = self->state;
  st.epoch_ns = epoch_ns;
  st.data = std::move(data);
  st.token = std::move(token);
  st.nodes = nodes;
  st.config_toml = std::move(config_toml);
  st.supervisors.resize(nodes);
  self->set_down_handler([self](const caf::down_msg& msg) { on_supervisor_down(self, msg); });
  return {
      [](clock_atom) -> std::int64_t { return steady_clock_ns(); },  // a node's clock probe
      [self](check_atom, std::int32_t node, std::int32_t pid) {  // fencing, after the grace
        if (self->state.lost.count(node) && live_node_process(self->state, node) == pid)
          end_node_process(node, pid, "lives on (frozen or cut off)");
      },
      [self](const node_hello& h) { return on_hello(self, h); },
      [self](const node_addresses& a) { return on_addresses(self, a); },
      [self](const node_ready& r) { return on_ready(self, r); },
      // The coordinator: the supervisor of the process that takes the place of node
      // `node`, whose supervisor `gone` was lost (answered once it is ready).
      [self](rejoin_atom, std::int32_t node, const caf::actor& gone) -> caf::result<caf::actor> {
        auto& s = self->state;
        if (node <= 0 || node >= s.nodes) return caf::make_error(caf::sec::runtime_error, "no node " + std::to_string(node));
        if (s.supervisors[node] && s.supervisors[node] != gone) return s.supervisors[node];
        auto rp = self->make_response_promise<caf::actor>();
        s.rejoin_waiters[node].push_back(rp);
        return rp;
      },
      [self](const node_unfit& u) { return on_unfit(self->state, u); },
      [self](run_atom) -> caf::result<std::vector<caf::actor>> {
        auto& s = self->state;
        if (!s.unfit.empty()) return caf::make_error(caf::sec::runtime_error, s.unfit);
        if (s.ready == s.nodes) return s.supervisors;
        auto rp = self->make_response_promise<std::vector<caf::actor>>();
        s.run_waiters.push_back(rp);
        return rp;
      },
  };
}

}  // namespace

registrar_actor spawn_registrar(caf::actor_system& sys, std::string token, int nodes, std::string config_toml,
                                std::int64_t epoch_ns, std::string data) {
  return sys.spawn(registrar, std::move(token), nodes, std::move(config_toml), epoch_ns, std::move(data));
}

void add_entries(node_addresses& table, const node_addresses& a) {
  auto& t = table;
  t.stages.insert(t.stages.end(), a.stages.begin(), a.stages.end());
  t.replicas.insert(t.replicas.end(), a.replicas.begin(), a.replicas.end());
  t.addresses.insert(t.addresses.end(), a.addresses.begin(), a.addresses.end());
  t.machines.insert(t.machines.end(), a.machines.begin(), a.machines.end());
  t.gpus.insert(t.gpus.end(), a.gpus.begin(), a.gpus.end());
  t.nccl_ids.insert(t.nccl_ids.end(), a.nccl_ids.begin(), a.nccl_ids.end());
}

caf::result<node_addresses> address_round::add(caf::local_actor* self, const node_addresses& a) {
  if (!sent_.insert(a.node).second)
    return caf::make_error(caf::sec::runtime_error, "node " + std::to_string(a.node) +
                                                        " sent its addresses twice in round " + std::to_string(a.round));
  table_.round = a.round;
  add_entries(table_, a);
  node_addresses ids;  // (what table_for reads of the node's own entries)
  ids.node = a.node;
  ids.stages = a.stages;
  ids.peers = a.peers;
  auto rp = self->make_response_promise();
  waiters_.emplace_back(std::move(ids), rp);
  return rp;
}

void address_round::deliver() {
  for (auto& [mine, w] : waiters_) w.deliver(table_for(table_, mine));
  waiters_.clear();
}

void address_round::fail(const caf::error& why) {
  for (auto& [mine, w] : waiters_) w.deliver(why);
  waiters_.clear();
}

node_addresses table_for(const node_addresses& all, const node_addresses& mine) {
  const std::set<std::int32_t> groups(mine.stages.begin(), mine.stages.end());
  const std::set<std::int32_t> peers(mine.peers.begin(), mine.peers.end());
  auto wanted = [&](std::size_t i) {
    const auto entry = all.stages[i];
    const auto rank = i < all.replicas.size() ? all.replicas[i] : -1;
    if (entry == -1) return peers.empty() || rank == mine.node || peers.count(rank) > 0;  // the world
    if (is_link_entry(entry)) return entry == link_entry(mine.node) || rank == mine.node;
    return groups.count(entry) > 0;
  };
  node_addresses out;
  out.node = all.node;
  out.round = all.round;
  // (The per-entry fields run in parallel; a field may be shorter than the entries.)
  auto keep = [](auto& to, const auto& from, std::size_t i) {
    if (i < from.size()) to.push_back(from[i]);
  };
  for (std::size_t i = 0; i < all.stages.size(); ++i) {
    if (!wanted(i)) continue;
    keep(out.stages, all.stages, i);
    keep(out.replicas, all.replicas, i);
    keep(out.addresses, all.addresses, i);
    keep(out.machines, all.machines, i);
    keep(out.gpus, all.gpus, i);
    keep(out.nccl_ids, all.nccl_ids, i);
  }
  // Groups that run over NCCL (the registrar put an id in their rank 0's entry, which the
  // node kept as a member): their members connect by the id, so their addresses go nowhere.
  std::set<std::int32_t> by_id;
  for (std::size_t i = 0; i < out.stages.size() && i < out.nccl_ids.size(); ++i)
    if (!out.nccl_ids[i].empty() && !is_link_entry(out.stages[i]) && out.stages[i] != -1) by_id.insert(out.stages[i]);
  for (std::size_t i = 0; i < out.stages.size() && i < out.addresses.size(); ++i)
    if (by_id.count(out.stages[i])) out.addresses[i] = std::string();
  return out;
}

}  // namespace troupe
