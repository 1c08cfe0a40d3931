#include "actors/node.hpp"

#include "compute/checkpoint_dir.hpp"
#include "compute/device.hpp"

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

#include "actors/coordinator_actor.hpp"
#include "actors/supervisor_actor.hpp"
#include "actors/trace.hpp"
#include "compute/trainer.hpp"
#include "messages/type_ids.hpp"
#include "transport/host_staging.hpp"
#include "transport/ipc/ipc.hpp"
#include "transport/nccl/nccl_communicator.hpp"
#include "transport/ordered_p2p.hpp"
#include "transport/ucx/ucx_communicator.hpp"

namespace troupe {

namespace {

using namespace std::chrono_literals;

// --- the registrar (node 0): admits nodes, exchanges addresses, collects supervisors ---

struct registrar_state {
  std::string token, config_toml, data;
  std::string unfit;  ///< why a node cannot run the job (node_unfit): the job does not start
  std::int64_t epoch_ns = 0;
  int nodes = 0;
  std::set<int> joined;
  // Address exchanges: round 0 as the nodes join, round n for the n-th in-place recovery.
  struct address_round {
    node_addresses table;
    std::set<int> sent;
    std::vector<caf::response_promise> waiters;
  };
  std::map<int, address_round> rounds;
  std::vector<caf::actor> supervisors;
  int ready = 0;
  std::vector<caf::response_promise> run_waiters;
  // Nodes whose supervisor is gone: a restarted process may take the place (rejoin).
  std::set<int> lost;
  std::map<int, caf::response_promise> early_rejoins;  // hellos that came before the loss was seen
  std::map<int, std::vector<caf::response_promise>> rejoin_waiters;  // the coordinator's, per node
};

caf::behavior registrar(caf::stateful_actor<registrar_state>* self, std::string token, int nodes,
                        std::string config_toml, std::int64_t epoch_ns, std::string data) {
  self->state.epoch_ns = epoch_ns;
  self->state.data = std::move(data);
  self->state.token = std::move(token);
  self->state.nodes = nodes;
  self->state.config_toml = std::move(config_toml);
  self->state.supervisors.resize(nodes);
  auto offer = [self] {
    return job_offer{self->state.config_toml, self->state.epoch_ns, transport::machine_key(), self->state.data};
  };
  auto admit_rejoin = [self](int node, const std::string& host) {
    auto& s = self->state;
    s.lost.erase(node);
    s.joined.insert(node);
    spdlog::info("node {} of {} rejoined from {}", node, s.nodes, host);
  };
  // A node's supervisor is gone (its process lost): another process may rejoin as it.
  self->set_down_handler([=](const caf::down_msg& msg) {
    auto& s = self->state;
    if (msg.reason == caf::exit_reason::user_shutdown) return;  // the job's end
    for (int i = 0; i < s.nodes; ++i)
      if (s.supervisors[i] && s.supervisors[i].address() == msg.source) {
        s.supervisors[i] = nullptr;
        s.joined.erase(i);
        s.lost.insert(i);
        --s.ready;
        if (auto it = s.early_rejoins.find(i); it != s.early_rejoins.end()) {
          admit_rejoin(i, "a process restarted by the launcher");
          it->second.deliver(offer());
          s.early_rejoins.erase(it);
        }
      }
  });
  return {
      [](clock_atom) -> std::int64_t { return steady_clock_ns(); },  // a node's clock probe
      [=](const node_hello& h) -> caf::result<job_offer> {
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
          return rp;
        } else if (h.rejoin && !s.lost.count(h.node))
          why = "node " + std::to_string(h.node) + " is not a lost node: it cannot rejoin";
        else if (!h.rejoin && (s.joined.count(h.node) || s.lost.count(h.node)))
          why = "node " + std::to_string(h.node) + " has already joined";
        if (!why.empty()) {
          spdlog::warn("refused a node claiming to be node {} from {}: {}", h.node, h.host, why);
          return caf::make_error(caf::sec::runtime_error, "join refused: " + why);
        }
        if (h.rejoin) {
          admit_rejoin(h.node, h.host);
        } else {
          s.joined.insert(h.node);
          spdlog::info("node {} of {} joined from {}", h.node, s.nodes, h.host);
        }
        return offer();
      },
      [=](const node_addresses& a) -> caf::result<node_addresses> {
        auto& s = self->state;
        if (!s.unfit.empty()) return caf::make_error(caf::sec::runtime_error, s.unfit);
        if (!s.joined.count(a.node))
          return caf::make_error(caf::sec::runtime_error, "addresses from a node that has not joined");
        auto& round = s.rounds[a.round];
        if (!round.sent.insert(a.node).second)
          return caf::make_error(caf::sec::runtime_error, "node " + std::to_string(a.node) +
                                                              " sent its addresses twice in round " +
                                                              std::to_string(a.round));
        auto& t = round.table;
        t.round = a.round;
        t.stages.insert(t.stages.end(), a.stages.begin(), a.stages.end());
        t.replicas.insert(t.replicas.end(), a.replicas.begin(), a.replicas.end());
        t.addresses.insert(t.addresses.end(), a.addresses.begin(), a.addresses.end());
        t.machines.insert(t.machines.end(), a.machines.begin(), a.machines.end());
        t.gpus.insert(t.gpus.end(), a.gpus.begin(), a.gpus.end());
        t.nccl_ids.insert(t.nccl_ids.end(), a.nccl_ids.begin(), a.nccl_ids.end());
        auto rp = self->make_response_promise<node_addresses>();
        round.waiters.push_back(rp);
        if (int(round.sent.size()) == s.nodes) {
          assign_nccl_ids(t, [] {
            try {
              const auto bytes = transport::nccl_unique_id();
              return std::string(bytes.begin(), bytes.end());
            } catch (const std::exception& e) {
              spdlog::warn("registrar: no NCCL id (that group or link stays on UCX): {}", e.what());
              return std::string();
            }
          });
          for (auto& w : round.waiters) w.deliver(t);
          s.rounds.erase(a.round);
        }
        return rp;
      },
      [=](const node_ready& r) -> caf::result<bool> {
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
      },
      // The coordinator: the supervisor of the process that takes the place of node
      // `node`, whose supervisor `gone` was lost (answered once it is ready).
      [=](rejoin_atom, std::int32_t node, const caf::actor& gone) -> caf::result<caf::actor> {
        auto& s = self->state;
        if (node <= 0 || node >= s.nodes) return caf::make_error(caf::sec::runtime_error, "no node " + std::to_string(node));
        if (s.supervisors[node] && s.supervisors[node] != gone) return s.supervisors[node];
        auto rp = self->make_response_promise<caf::actor>();
        s.rejoin_waiters[node].push_back(rp);
        return rp;
      },
      [=](const node_unfit& u) -> bool {
        auto& s = self->state;
        s.unfit = "node " + std::to_string(u.node) + " on " + u.host + " cannot run this job: " + u.reason;
        spdlog::error("{}", s.unfit);
        const auto why = caf::make_error(caf::sec::runtime_error, s.unfit);
        for (auto& w : s.run_waiters) w.deliver(why);
        s.run_waiters.clear();
        for (auto& [round, r] : s.rounds)
          for (auto& w : r.waiters) w.deliver(why);
        s.rounds.clear();
        for (auto& w : s.rejoin_waiters[u.node]) w.deliver(why);
        s.rejoin_waiters.erase(u.node);
        return true;
      },
      [=](run_atom) -> caf::result<std::vector<caf::actor>> {
        auto& s = self->state;
        if (!s.unfit.empty()) return caf::make_error(caf::sec::runtime_error, s.unfit);
        if (s.ready == s.nodes) return s.supervisors;
        auto rp = self->make_response_promise<std::vector<caf::actor>>();
        s.run_waiters.push_back(rp);
        return rp;
      },
  };
}

std::string hostname() {
  char buf[256] = {0};
  ::gethostname(buf, sizeof buf - 1);
  return buf;
}

/// How a node's tensors travel to other nodes: through host copies (`staged`:
/// transport/host_staging.hpp; GPU tensors over the UCX backend) and, between node
/// processes of one machine, point-to-point through shared buffers (`ipc`:
/// transport/ipc/ipc.hpp; CUDA IPC on a GPU).
struct node_transport {
  enum class staging { off, device_tensors, all_tensors } staged = staging::off;
  enum class ipc_memory { off, host, cuda } ipc = ipc_memory::off;
  int device = 0;  ///< the node's GPU (CUDA IPC buffers, NCCL)
  /// The shard groups' collectives, and the tensors between stages on nodes of
  /// link_pairs(), over NCCL where every member has a GPU of its own (TROUPE_NCCL=1).
  bool nccl = false;
  /// Tests of the links without NCCL: the tensors between stages on nodes of link_pairs()
  /// through ordered_p2p over links on one UCX tag (TROUPE_LINKS=ucx).
  bool ucx_links = false;
};

/// The UCX tag of tag links (TROUPE_LINKS=ucx): the callers' tags are below 2^31, the
/// acknowledgements of ipc/ are 2^31 plus a buffer number.
constexpr std::uint32_t kLinkTag = 0xfffffff0u;

/// The table's `stages` entry of a link from node `from` (its `replicas` entry names the
/// receiving node, its `nccl_ids` entry the id): -2 - from (-1 is the world).
constexpr std::int32_t link_entry(int from) { return -2 - from; }

/// A node's communicators: per slot (r, k) rank r of stage k's d shards, and the world of
/// the nodes (rank = node), which carries activations between them. Made at join and
/// again for every in-place recovery; addresses (and machine keys, GPU keys, NCCL ids) go
/// through the registrar (stage -1: the world). The shard groups only run collectives:
/// over NCCL where `transport.nccl` asks and every member has a GPU of its own
/// (nccl_refusal), else over UCX. The world is UCX; its point-to-point to nodes of this
/// machine goes through shared buffers where `transport.ipc` says so.
class ucx_renewal : public comm_renewal {
 public:
  ucx_renewal(int node, int nodes, int p, int d, std::vector<std::pair<int, int>> slots, node_transport transport)
      : node_(node), nodes_(nodes), d_(d), slots_(std::move(slots)), transport_(transport),
        machine_(transport::machine_key()), links_(transport.nccl || transport.ucx_links ? link_pairs(p, d, nodes)
                                                                                          : decltype(links_){}) {
    mine_.node = node;
    std::string gpu;  // asks for NCCL: names its GPU
    if (transport_.nccl) try {
        gpu = transport::gpu_key(transport_.device);
      } catch (const std::exception& e) {
        spdlog::warn("node {}: the shard groups' collectives and the tensors between nodes stay off NCCL: {}", node_,
                     e.what());
      }
    auto add = [this](int stage, int rank, const std::string& address, const std::string& gpu) {
      mine_.stages.push_back(stage);
      mine_.replicas.push_back(rank);
      mine_.addresses.push_back(address);
      mine_.machines.push_back(machine_);
      mine_.gpus.push_back(gpu);
      mine_.nccl_ids.emplace_back();  // the registrar adds the NCCL ids (assign_nccl_ids)
    };
    for (const auto& [r, k] : slots_) {
      pending_.push_back(transport::prepare_ucx_communicator(r, d));
      add(k, r, pending_.back()->address(), gpu);
    }
    pending_.push_back(transport::prepare_ucx_communicator(node, nodes));
    add(-1, node, pending_.back()->address(), gpu);  // the world: with this node's GPU key
    if (!gpu.empty())  // the links this node sends on (no address: a NCCL id's place)
      for (const auto& [from, to] : links_)
        if (from == node_) add(link_entry(from), to, "", "");
  }
  node_addresses addresses() const override { return mine_; }
  node_plan connect(const node_addresses& table) override {
    // One field of the table for the ranks of `stage` (-1: the world), by rank.
    auto column = [&](int stage, int size, const std::vector<std::string>& field) {
      std::vector<std::string> out(size);
      for (std::size_t i = 0; i < table.stages.size() && i < field.size(); ++i)
        if (table.stages[i] == stage) out.at(table.replicas[i]) = field[i];
      return out;
    };
    using staging = node_transport::staging;
    auto staged = [this](std::shared_ptr<transport::communicator> c) {
      if (transport_.staged == staging::off) return c;
      return transport::stage_through_host(std::move(c), /*always=*/transport_.staged == staging::all_tensors);
    };
    node_plan plan;
    plan.node = node_;
    plan.slots = slots_;
    // NCCL communicators are made in the order of the stages on every node (making one
    // waits for its other ranks: no node may wait on a group another node makes later).
    std::vector<std::size_t> order(slots_.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](auto a, auto b) { return slots_[a].second < slots_[b].second; });
    plan.comms.resize(slots_.size());
    for (const auto i : order) {
      const auto [r, k] = slots_[i];
      auto refusal = transport_.nccl ? nccl_refusal(column(k, d_, table.gpus)) : "not asked for";
      const auto id = column(k, d_, table.nccl_ids).at(0);
      if (refusal.empty() && id.empty()) refusal = "node 0 made no NCCL id for it (see its log)";
      if (refusal.empty()) {
        const torch::Device gpu(torch::kCUDA, static_cast<c10::DeviceIndex>(transport_.device));
        // Staged: a rejoined node's shard state (buddy copies) is in host memory.
        plan.comms[i] = transport::stage_through_device(
            transport::make_nccl_communicator(std::vector<char>(id.begin(), id.end()), r, d_, transport_.device), gpu);
        spdlog::info("node {}: stage {}'s shard collectives (rank {} of {}) over NCCL on {}", node_, k, r, d_,
                     gpu.str());
      } else {
        if (transport_.nccl) spdlog::info("node {}: stage {}'s shard collectives stay on UCX: {}", node_, k, refusal);
        plan.comms[i] = staged(pending_[i]->connect(column(k, d_, table.addresses)));
      }
    }
    for (const auto& [r, k] : slots_)
      if (k == 0) plan.loader_replicas.push_back(r);
    plan.world = staged(pending_.back()->connect(column(-1, nodes_, table.addresses)));
    auto [to, from] = make_links(table, column(-1, nodes_, table.gpus), plan.world);
    if (transport_.ipc != node_transport::ipc_memory::off) {
      std::vector<bool> same(nodes_, false);
      for (std::size_t i = 0; i < table.stages.size() && i < table.machines.size(); ++i)
        if (table.stages[i] == -1 && table.replicas[i] != node_) same.at(table.replicas[i]) = table.machines[i] == machine_;
      std::string peers;
      for (int n = 0; n < nodes_; ++n)
        if (same[n]) peers += (peers.empty() ? "" : ", ") + std::to_string(n);
      std::shared_ptr<transport::ipc_memory> memory;
      if (!peers.empty()) try {
          memory = transport_.ipc == node_transport::ipc_memory::cuda ? transport::cuda_ipc_memory(transport_.device)
                                                                       : transport::host_ipc_memory();
        } catch (const std::exception& e) {
          spdlog::warn("node {}: no shared buffers for node(s) {} (this machine), their tensors go over UCX: {}", node_,
                       peers, e.what());
        }
      if (memory) {
        plan.world = transport::ipc_p2p(plan.world, std::move(memory), same);
        spdlog::info("node {}: tensors to node(s) {} (this machine): {}", node_, peers, plan.world->backend());
      }
    }
    if (std::any_of(to.begin(), to.end(), [](const auto& l) { return l != nullptr; }) ||
        std::any_of(from.begin(), from.end(), [](const auto& l) { return l != nullptr; })) {
      plan.world = transport::ordered_p2p(plan.world, std::move(to), std::move(from));
      spdlog::info("node {}: tensors between nodes: {}", node_, plan.world->backend());
    }
    return plan;
  }

 private:
  int node_, nodes_, d_;
  std::vector<std::pair<int, int>> slots_;
  node_transport transport_;
  std::string machine_;  // transport::machine_key(), sent with the addresses
  std::vector<std::unique_ptr<transport::ucx_pending>> pending_;  // per slot, then the world
  node_addresses mine_;
  std::vector<std::pair<int, int>> links_;  // link_pairs() where links are asked for

  /// This node's links (by peer: to it, from it), made in the order of links_ on every
  /// node (making a NCCL link waits for its peer). NCCL links where both ends asked and
  /// have GPUs of their own (by the world entries' GPU keys); tag links over `world`
  /// where TROUPE_LINKS=ucx asks.
  using links = std::vector<std::shared_ptr<transport::ordered_link>>;
  std::pair<links, links> make_links(const node_addresses& table, const std::vector<std::string>& gpus,
                                     const std::shared_ptr<transport::communicator>& world) const {
    links to(nodes_), from(nodes_);
    for (const auto& [a, b] : links_) {
      if (a != node_ && b != node_) continue;
      const bool sends = a == node_;
      auto& slot = sends ? to[b] : from[a];
      if (transport_.ucx_links) {
        slot = transport::tag_link(world, sends ? b : a, kLinkTag);
        continue;
      }
      const auto refusal = nccl_refusal({gpus.at(a), gpus.at(b)});
      std::string id;
      for (std::size_t i = 0; i < table.stages.size() && i < table.nccl_ids.size(); ++i)
        if (table.stages[i] == link_entry(a) && table.replicas[i] == b) id = table.nccl_ids[i];
      if (!refusal.empty() || id.empty()) {
        const auto why = refusal.empty() ? std::string("node 0 made no NCCL id for it (see its log)")
                                         : "nodes " + std::to_string(a) + " and " + std::to_string(b) + " as " + refusal;
        if (sends) spdlog::info("node {}: tensors to node {} stay off NCCL: {}", node_, b, why);
        continue;
      }
      slot = transport::make_nccl_link(std::vector<char>(id.begin(), id.end()), sends, transport_.device);
      spdlog::info("node {}: tensors {} node {} over a NCCL link on cuda:{}", node_, sends ? "to" : "from",
                   sends ? b : a, transport_.device);
    }
    return {std::move(to), std::move(from)};
  }
};

/// How this node's tensors travel, with the reasons logged. On a GPU: tensors staged
/// through host memory, because the UCX backend moves host memory only (even where UCX
/// itself could move CUDA memory), and point-to-point to node processes of this machine
/// through CUDA IPC buffers (where the build has the CUDA runtime). On the CPU: plain UCX
/// (its shared-memory transports already map host memory). For tests of these paths
/// without a GPU: TROUPE_STAGE_THROUGH_HOST=1 stages CPU tensors too, TROUPE_IPC=host
/// moves point-to-point through POSIX shared memory; TROUPE_IPC=0 turns the buffers off.
node_transport transport_for(const runtime_context& ctx, const std::string& where) {
  using staging = node_transport::staging;
  using ipc_memory = node_transport::ipc_memory;
  node_transport t;
  const char* stage_env = std::getenv("TROUPE_STAGE_THROUGH_HOST");
  const char* ipc_env = std::getenv("TROUPE_IPC");
  const std::string ipc = ipc_env ? ipc_env : "";
  if (stage_env && std::string(stage_env) == "1") {
    spdlog::info("{}: TROUPE_STAGE_THROUGH_HOST=1: every tensor between nodes goes through a host copy", where);
    t.staged = staging::all_tensors;
  } else if (!ctx.device.is_cpu()) {
    std::string types;
    for (const auto& m : transport::ucx_memory_types()) types += (types.empty() ? "" : ", ") + m;
    spdlog::info("{}: {} tensors between nodes are staged through host memory (copied out before sending, in after "
                 "receiving): Troupe's UCX backend moves host memory (memory types this UCX can move: {})",
                 where, ctx.device.str(), types);
    t.staged = staging::device_tensors;
  }
  if (ctx.device.is_cuda()) t.device = ctx.device.has_index() ? ctx.device.index() : 0;
  const char* nccl_env = std::getenv("TROUPE_NCCL");
  const std::string nccl = nccl_env ? nccl_env : "";
  if (nccl == "1") {
    if (!ctx.device.is_cuda()) throw config_error("TROUPE_NCCL=1: the job does not run on a GPU (--device cuda)");
    if (!transport::nccl_built()) throw config_error("TROUPE_NCCL=1: this build has no NCCL backend");
    spdlog::info("{}: TROUPE_NCCL=1: the optimizer shards' collectives, and the tensors between stages on different "
                 "nodes, go over NCCL where the nodes involved each have a GPU of their own (not yet run on GPUs: "
                 "see README)", where);
    t.nccl = true;
  } else if (!nccl.empty() && nccl != "0") {
    throw config_error("TROUPE_NCCL=" + nccl + ": expected 1 or 0");
  }
  const char* links_env = std::getenv("TROUPE_LINKS");
  const std::string links = links_env ? links_env : "";
  if (links == "ucx") {
    spdlog::info("{}: TROUPE_LINKS=ucx: tensors between stages on different nodes go through in-order links over one "
                 "UCX tag (the ordering that NCCL links need, without NCCL)", where);
    t.ucx_links = true;
  } else if (!links.empty() && links != "0") {
    throw config_error("TROUPE_LINKS=" + links + ": expected ucx or 0");
  }
  if (ipc == "host") {
    spdlog::info("{}: TROUPE_IPC=host: tensors to node processes of this machine go through POSIX shared memory", where);
    t.ipc = ipc_memory::host;
  } else if (ipc == "0" || ipc == "off") {
    spdlog::info("{}: TROUPE_IPC={}: no shared buffers between node processes of this machine", where, ipc);
  } else if (!ipc.empty() && ipc != "cuda") {
    throw config_error("TROUPE_IPC=" + ipc + ": expected host, cuda, 0 or off");
  } else if (ctx.device.is_cuda()) {
    if (transport::cuda_ipc_built()) {
      t.ipc = ipc_memory::cuda;
      spdlog::info("{}: {} tensors to node processes of this machine go through CUDA IPC buffers (to other machines "
                   "over UCX)", where, ctx.device.str());
    } else {
      spdlog::warn("{}: this build has no CUDA runtime: tensors to node processes of this machine are staged through "
                   "host memory too", where);
    }
  } else if (ipc == "cuda") {
    throw config_error("TROUPE_IPC=cuda: the job does not run on a GPU (--device cuda)");
  }
  return t;
}

struct node_failure : std::runtime_error {
  node_failure(int code, const std::string& what) : std::runtime_error(what), code(code) {}
  int code;
};

/// Blocking request from the node's main thread.
template <class Reply, class Msg>
Reply ask(caf::scoped_actor& self, const caf::actor& dest, std::chrono::milliseconds timeout, Msg&& msg,
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
    const auto mine = training_data::fingerprint(cfg);
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
void tell_node_zero_unfit(caf::actor_system& sys, const caf::actor& registrar, const node_options& o,
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
std::shared_ptr<job_clock> node_job_clock(caf::scoped_actor& self, const caf::actor& registrar,
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

struct clock_probe_state {
  std::vector<clock_sample> samples;
  std::chrono::milliseconds wait{100};  ///< until the next round
};

/// A node on another machine than node 0's: probe rounds (8 round trips to the registrar,
/// one at a time), each refitting `clock`'s line, so trace events stay on node 0's
/// timeline while the two clocks drift apart. The first comes 0.1 s after the join probe
/// and the waits double up to `interval`: the rate is known early, and each estimate of it
/// (good to the offset's error over the span probed) is used for no longer than that span.
caf::behavior clock_probe_keeper(caf::stateful_actor<clock_probe_state>* self, caf::actor registrar,
                                 std::shared_ptr<job_clock> clock, std::chrono::milliseconds interval) {
  self->state.wait = std::min(self->state.wait, interval);
  self->delayed_send(self, self->state.wait, timeout_atom_v);
  return {
      [=](timeout_atom) {
        const auto sent = clock->local_ns();
        self->request(registrar, std::chrono::seconds(10), clock_atom_v)
            .then(
                [=](std::int64_t remote) {
                  auto& s = self->state;
                  s.samples.push_back({sent, remote, clock->local_ns()});
                  if (s.samples.size() < 8) {
                    self->send(self, timeout_atom_v);
                    return;
                  }
                  clock->add_probe(s.samples);
                  s.samples.clear();
                  s.wait = std::min(2 * s.wait, interval);
                  self->delayed_send(self, s.wait, timeout_atom_v);
                },
                [=](caf::error&) {  // no answer in 10 s: try a new round later (node 0 gone: the node ends)
                  self->state.samples.clear();
                  self->delayed_send(self, self->state.wait, timeout_atom_v);
                });
      },
  };
}

caf::actor connect_to_registrar(caf::actor_system& sys, const node_options& o) {
  const auto deadline = std::chrono::steady_clock::now() + o.join_timeout;
  std::string last;
  while (std::chrono::steady_clock::now() < deadline) {
    auto r = use_tls(o) ? caf::openssl::remote_actor<caf::actor>(sys, o.host, o.port)
                        : sys.middleman().remote_actor(o.host, o.port);
    if (r) return *r;
    last = sys.render(r.error());
    std::this_thread::sleep_for(200ms);
  }
  throw node_failure(1, "node " + std::to_string(o.node) + ": cannot reach the coordinator at " + o.host + ":" +
                            std::to_string(o.port) + " within " + std::to_string(o.join_timeout.count() / 1000) +
                            " s (" + last + ")");
}

}  // namespace

std::vector<std::pair<int, int>> link_pairs(int p, int d, int nodes) {
  std::set<std::pair<int, int>> pairs;
  const int per = p * d / nodes;
  auto node_of = [&](int r, int k) { return (r * p + k) / per; };
  auto both_ways = [&](int a, int b) {
    if (a == b) return;
    pairs.emplace(a, b);
    pairs.emplace(b, a);
  };
  for (int r = 0; r < d; ++r) {
    for (int k = 0; k + 1 < p; ++k) both_ways(node_of(r, k), node_of(r, k + 1));
    both_ways(node_of(r, 0), node_of(r, p - 1));
  }
  return {pairs.begin(), pairs.end()};
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
  // Per group (a stage >= 0, or the world -1): its members' GPU keys by rank.
  std::map<int, std::vector<std::string>> keys;
  for (std::size_t i = 0; i < n; ++i)
    if (table.stages[i] >= -1 && table.replicas[i] >= 0) {
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
    if (stage >= 0 && rank == 0)
      refusal = nccl_refusal(keys[stage]);
    else if (stage <= -2)
      refusal = nccl_refusal({world_key(-2 - stage), world_key(rank)});
    else
      continue;  // no id: the world, and a shard group's other ranks
    if (!refusal.empty()) continue;
    table.nccl_ids[i] = make_id();
    if (!table.nccl_ids[i].empty()) ++given;
  }
  return given;
}

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
    acfg.load<caf::io::middleman>();
    acfg.add_message_types<caf::id_block::troupe>();
    acfg.set("scheduler.policy", caf::atom("sharing"));
    acfg.set("scheduler.max-threads", std::size_t{2});
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
    caf::actor_system sys{acfg};
    caf::actor registrar_handle, supervisor, clock_keeper;
    bool joined = false;  // a node other than 0 between its join and its node_ready
    try {
      {
        caf::scoped_actor self{sys};
        job_config cfg;
        if (o.node == 0) {
          cfg = o.cfg;
          cfg.validate();
          resolve_resume(cfg);  // one checkpoint folder for every node (they get this config)
          node_slots(cfg.pipeline, cfg.data_parallel, 0, o.nodes);  // the layout fits, or a clear error now
          const auto data = training_data::fingerprint(cfg);  // the data every node must read
          check_output_paths(cfg);
          registrar_handle = sys.spawn(registrar, o.token, o.nodes, cfg.to_toml(), steady_clock_ns(), data);
          auto port = use_tls(o) ? caf::openssl::publish(registrar_handle, o.port, nullptr, true)
                                 : sys.middleman().publish(registrar_handle, o.port, nullptr, true);
          if (!port)
            throw node_failure(1, "node 0: cannot listen on port " + std::to_string(o.port) + ": " +
                                      sys.render(port.error()));
          spdlog::info("node 0 of {}: coordinator listening on port {}{}", o.nodes, *port, use_tls(o) ? " (TLS)" : "");
        } else {
          registrar_handle = connect_to_registrar(sys, o);
        }
        const std::string where = "node " + std::to_string(o.node);
        const auto offer = ask<job_offer>(self, registrar_handle, o.join_timeout,
                                           node_hello{o.version ? o.version : protocol_version, o.token, o.node,
                                                      o.nodes, hostname(), o.rejoin},
                                           where, 3);
        if (o.node != 0) {
          joined = true;  // from here a failure before node_ready is told to node 0
          cfg = job_config_from_toml(offer.config_toml, "the coordinator's job config");
          check_node_data(cfg, offer, where);
        }
        if (o.rejoin) cfg.fault_attempt = -1;  // the faults of this launch were the old process's
        const auto slots = node_slots(cfg.pipeline, cfg.data_parallel, o.node, o.nodes);
        // threads = 0: share the machine's cores between the stage actors of every node on
        // it (more OpenMP threads than cores, in several processes, spin against each other).
        if (cfg.threads == 0)
          cfg.threads = std::max(1, int(std::thread::hardware_concurrency()) /
                                        (int(slots.size()) * std::max(1, o.nodes_per_host)));
        // One timeline for the trace and the measured bubble: node 0's clock from the
        // coordinator's start (node_job_clock).
        const auto clock = node_job_clock(self, registrar_handle, offer, o, where);
        if (clock->probes() > 0 && o.clock_probe_interval.count() > 0)
          clock_keeper = sys.spawn(clock_probe_keeper, registrar_handle, clock, o.clock_probe_interval);
        if (cfg.device == "cuda") {  // one GPU per node process of this machine, while there are enough
          const int gpus = cuda_device_count();
          cfg.device = node_device(cfg.device, o.local_node, gpus);
          spdlog::info("{}: computes on {}{} (this machine has {} GPU(s))", where, cfg.device,
                       cfg.deterministic ? " with deterministic algorithms" : "", gpus);
          if (o.nodes_per_host > gpus && gpus > 0 && o.local_node == 0)
            spdlog::warn("{}: {} node processes share this machine's {} GPU(s)", where, o.nodes_per_host, gpus);
        }
        // this node's stages' parameters (and moments), not the whole model's
        std::shared_ptr<const runtime_context> ctx = std::make_shared<runtime_context>(cfg, clock, slots);
        const auto how = transport_for(*ctx, where);
        node_plan plan;
        if (o.rejoin) {  // communicators come with the coordinator's recovery round
          plan.node = o.node;
          plan.slots = slots;
          plan.rejoining = true;
        } else {  // UCX communicators (round 0 of the address exchange)
          ucx_renewal comms(o.node, o.nodes, ctx->p, ctx->d, slots, how);
          const auto table = ask<node_addresses>(self, registrar_handle, o.join_timeout, comms.addresses(),
                                                 where + ": address exchange");
          plan = comms.connect(table);
        }
        plan.registrar = registrar_handle;
        plan.renew = [node = o.node, nodes = o.nodes, p = ctx->p, d = ctx->d, slots,
                      how]() -> std::unique_ptr<comm_renewal> {
          return std::make_unique<ucx_renewal>(node, nodes, p, d, slots, how);
        };
        std::string hosted;
        for (const auto& [r, k] : slots) hosted += " (" + std::to_string(r) + "," + std::to_string(k) + ")";
        supervisor = sys.spawn(supervisor_actor, ctx, wiring, std::move(plan));
        ask<bool>(self, registrar_handle, o.join_timeout, node_ready{o.node, supervisor}, where + ": ready");
        joined = false;
        const std::string here = o.nodes_per_host > 1 ? ", node process " + std::to_string(o.local_node + 1) + " of " +
                                                             std::to_string(o.nodes_per_host) + " on this machine"
                                                       : "";
        spdlog::info("{} on {} (pid {}{}): stages (replica,stage){}{}", where, hostname(), ::getpid(), here, hosted,
                     o.rejoin ? ": rejoined the job, waiting for the coordinator's recovery" : "");
        if (o.node == 0) {
          const auto supervisors = ask<std::vector<caf::actor>>(self, registrar_handle, o.join_timeout, run_atom_v,
                                                                "node 0: waiting for the other nodes");
          if (!o.run.quiet)
            spdlog::info("training {}{} for {} steps on {} nodes: pipeline {} x data-parallel {}, {} micro-batches of {} "
                         "({}), {} intra-op thread(s) per stage{}",
                         cfg.model_label(), cfg.data_label(), cfg.steps, o.nodes, cfg.pipeline, cfg.data_parallel, cfg.microbatches,
                         cfg.microbatch_size(), cfg.schedule_label(), cfg.threads, cfg.compute_note());
          auto run_opts = o.run;
          if (run_opts.trace_path.empty()) run_opts.trace_path = cfg.trace;
          auto coordinator =
              spawn_coordinator_actor(sys, ctx, wiring, run_opts, shared_result, supervisors, registrar_handle);
          self->request(coordinator, caf::infinite, run_atom_v)
              .receive([&](int code) { shared_result->exit_code = code; },
                       [&](caf::error& err) {
                         shared_result->exit_code = 1;
                         if (shared_result->error.empty()) shared_result->error = "coordinator failed: " + sys.render(err);
                       });
          // The coordinator told every supervisor to stop: wait until they have (so the
          // other nodes get the word before this process closes its connections). The
          // registrar knows the current ones (a rejoined node's replaces the lost one's);
          // a node lost for good leaves its old, dead one (its down comes at once).
          auto current = supervisors;
          self->request(registrar_handle, 1s, run_atom_v)
              .receive([&](std::vector<caf::actor>& now) { current = std::move(now); }, [](caf::error&) {});
          for (auto& sup : current) self->monitor(sup);
          std::size_t down = 0;
          bool waiting = true;
          while (waiting && down < current.size())
            self->receive([&](const caf::down_msg&) { ++down; }, caf::after(10s) >> [&] { waiting = false; });
          result = *shared_result;
        } else {
          // Serve until the coordinator stops our supervisor, or node 0 is gone. Ending any
          // other way, the process ends with the recoverable status: the launcher starts it
          // again, and it rejoins the job if node 0 is still there (a link that was cut
          // for a while, node 0 stalled past the connection timeout); if node 0 is gone
          // for good, the launcher restarts the whole job anyway.
          self->monitor(supervisor);
          self->monitor(registrar_handle);
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
      result.exit_code = 1;
      result.error = "node " + std::to_string(o.node) + ": " + e.what();
      if (supervisor) caf::anon_send_exit(supervisor, caf::exit_reason::user_shutdown);
    }
    if (joined && result.exit_code != 0 && registrar_handle) tell_node_zero_unfit(sys, registrar_handle, o, result.error);
    if (clock_keeper) caf::anon_send_exit(clock_keeper, caf::exit_reason::user_shutdown);
    clock_keeper = nullptr;
    if (registrar_handle && o.node == 0) caf::anon_send_exit(registrar_handle, caf::exit_reason::user_shutdown);
    registrar_handle = nullptr;
    supervisor = nullptr;
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
