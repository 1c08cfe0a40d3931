#include "actors/node_transport.hpp"

#include <algorithm>
#include <any>
#include <map>
#include <numeric>
#include <set>

#include <spdlog/spdlog.h>

#include "actors/node.hpp"
#include "messages/node_messages.hpp"
#include "transport/host_staging.hpp"
#include "transport/hybrid.hpp"
#include "transport/ipc/ipc.hpp"
#include "transport/local/local_group.hpp"
#include "transport/nccl/nccl_communicator.hpp"
#include "transport/ordered_p2p.hpp"
#include "transport/ucx/ucx_communicator.hpp"

namespace troupe {

namespace {

/// The UCX tag of tag links (TROUPE_LINKS=ucx): the callers' tags are below 2^31, the
/// acknowledgements of ipc/ are 2^31 plus a buffer number.
constexpr std::uint32_t kLinkTag = 0xfffffff0u;

/// The indices 0 .. n-1 from the highest `entry_of` to the lowest: the order in which
/// every node makes the groups of one kind (making a NCCL communicator waits for its other
/// ranks, so no node may wait on a group another node makes later).
template <class EntryOf>
std::vector<std::size_t> in_entry_order(std::size_t n, EntryOf entry_of) {
  std::vector<std::size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](auto a, auto b) { return entry_of(a) > entry_of(b); });
  return order;
}

/// A node's communicators: per slot (r, k) rank r of stage k's d shards, the world of the
/// nodes (rank = node), which carries activations between them, and (expert parallelism)
/// per slot rank r mod EP of its stage's two expert-parallel groups (forwards',
/// backwards') and rank r / EP of its shard's expert-data-parallel group. Made at join and
/// again for every in-place recovery; addresses (and machine keys, GPU keys, NCCL ids) go
/// through the registrar (stage -1: the world). The shard groups only run collectives:
/// over NCCL where `transport.nccl` asks and every member has a GPU of its own
/// (nccl_refusal), else over UCX. The world is UCX; its point-to-point to nodes of this
/// machine goes through shared buffers where `transport.ipc` says so.
class ucx_renewal : public comm_renewal {
 public:
  ucx_renewal(int node, int nodes, int p, int d, int t, int ep, int c, std::vector<std::pair<int, int>> slots,
              node_transport transport)
      : node_(node), nodes_(nodes), d_(d), t_(t), ep_(ep), c_(c), slots_(std::move(slots)), transport_(transport),
        machine_(transport::machine_key()), links_(transport.nccl || transport.ucx_links ? link_pairs(p, d, nodes, t)
                                                                                          : decltype(links_){}) {
    mine_.node = node;
    mine_.peers = world_peers(p, d, nodes, t, node);  // the world connects to these only
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
    for (const auto& [r, k] : slots_) {  // (the table's entry of a shard group: its (stage, tp))
      pending_.push_back(transport::prepare_ucx_communicator(r / t_, d));
      add(shard_group(r, k), r / t_, pending_.back()->address(), gpu);
    }
    auto world = transport::process_ucx_options();  // connected to world_peers only
    world.sparse = true;
    world.spin = transport::resolve_spin(world.spin, transport_.host_nodes, world.tls);
    pending_.push_back(transport::prepare_ucx_communicator(node, nodes, world));
    add(-1, node, pending_.back()->address(), gpu);  // the world: with this node's GPU key
    if (t_ > 1)  // tensor-parallel groups that span nodes (the others are made in connect)
      for (const auto& [q, k] : slots_)
        if (!whole_group_here(q, k)) {
          tensors_.push_back(transport::prepare_ucx_communicator(q % t_, t_));
          add(tensor_group_entry(k, q / t_, d_), q % t_, tensors_.back()->address(), gpu);
        }
    if (c_ > 1)  // context-parallel groups that span nodes (the others are made in connect)
      for (const auto& [q, k] : slots_)
        if (!whole_context_group_here(q, k)) {
          contexts_.push_back(transport::prepare_ucx_communicator(q / t_ % c_, c_));
          add(context_entry(q, k), q / t_ % c_, contexts_.back()->address(), gpu);
        }
    if (ep_ > 1)
      for (const auto& [r, k] : slots_) {
        for (const bool backward : {false, true}) {
          experts_.push_back(transport::prepare_ucx_communicator(r % ep_, ep_));
          add(expert_group_entry(k, r / ep_, d_ * t_ / ep_, backward), r % ep_, experts_.back()->address(), gpu);
        }
        expert_shards_.push_back(transport::prepare_ucx_communicator(r / ep_, d_ * t_ / ep_));
        add(expert_shard_entry(k, r % ep_, ep_), r / ep_, expert_shards_.back()->address(), gpu);
      }
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
    // A group's communicator: NCCL where asked for and every member has a GPU of its own
    // (the registrar put an id in its rank 0's entry), else UCX. Making a NCCL one waits
    // for its other ranks.
    auto group_comm = [&](int entry, int rank, int size, transport::ucx_pending& ucx,
                          const std::string& what) -> std::shared_ptr<transport::communicator> {
      auto refusal = transport_.nccl ? nccl_refusal(column(entry, size, table.gpus)) : "not asked for";
      const auto id = column(entry, size, table.nccl_ids).at(0);
      if (refusal.empty() && id.empty()) refusal = "node 0 made no NCCL id for it (see its log)";
      if (!refusal.empty()) {
        if (transport_.nccl) spdlog::info("node {}: {} stay on UCX: {}", node_, what, refusal);
        return staged(ucx.connect(column(entry, size, table.addresses)));
      }
      const torch::Device gpu(torch::kCUDA, static_cast<c10::DeviceIndex>(transport_.device));
      // Staged: a rejoined node's shard state (buddy copies) is in host memory.
      auto comm = transport::stage_through_device(
          transport::make_nccl_communicator(std::vector<char>(id.begin(), id.end()), rank, size, transport_.device), gpu);
      spdlog::info("node {}: {} (rank {} of {}) over NCCL on {}", node_, what, rank, size, gpu.str());
      return comm;
    };
    node_plan plan;
    plan.node = node_;
    plan.slots = slots_;
    // NCCL communicators are made in the order of the shard groups (stage, tp) on every
    // node (making one waits for its other ranks: no node may wait on a group another
    // node makes later), then the tensor-parallel groups spread over nodes (at most one
    // per node), then the expert groups and the expert-data-parallel groups, each in the
    // order of their entries.
    std::vector<std::size_t> order(slots_.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](auto a, auto b) {
      return shard_group(slots_[a].first, slots_[a].second) < shard_group(slots_[b].first, slots_[b].second);
    });
    plan.comms.resize(slots_.size());
    for (const auto i : order) {
      const auto [q, k] = slots_[i];
      plan.comms[i] = group_comm(shard_group(q, k), q / t_, d_, *pending_[i],
                                 "stage " + std::to_string(k) + "'s shard collectives");
      if (transport_.shard_group > 0)
        plan.comms[i] = transport::hybrid_shard_group(std::move(plan.comms[i]), transport_.shard_group,
                                                      transport::process_ucx_options().timeout);
    }
    if (t_ > 1) {  // tensor-parallel groups: in process where the group is here, else over UCX
      std::map<std::pair<int, int>, std::vector<std::shared_ptr<transport::communicator>>> groups;
      std::size_t next = 0;
      for (const auto& [q, k] : slots_) {
        if (!whole_group_here(q, k)) {
          plan.tp_comms.push_back(group_comm(tensor_group_entry(k, q / t_, d_), q % t_, t_, *tensors_.at(next++),
                                             "stage " + std::to_string(k) + "'s tensor-parallel collectives"));
          continue;
        }
        auto& g = groups[{q / t_, k}];
        if (g.empty()) g = transport::make_local_group(t_);
        plan.tp_comms.push_back(g.at(std::size_t(q % t_)));
      }
    }
    if (c_ > 1) {  // context-parallel groups: one per (replica, stage, tp), rank cp: in process
      // where the group is here, else over UCX
      std::map<std::tuple<int, int, int>, std::vector<std::shared_ptr<transport::communicator>>> groups;
      std::size_t next = 0;
      for (const auto& [q, k] : slots_) {
        if (!whole_context_group_here(q, k)) {
          plan.cp_comms.push_back(
              staged(contexts_.at(next++)->connect(column(context_entry(q, k), c_, table.addresses))));
          continue;
        }
        auto& g = groups[{q / (t_ * c_), k, q % t_}];
        if (g.empty()) g = transport::make_local_group(c_);
        plan.cp_comms.push_back(g.at(std::size_t(q / t_ % c_)));
      }
    }
    for (const auto& [r, k] : slots_)
      if (k == 0) plan.loader_replicas.push_back(r);
    plan.world = staged(pending_.back()->connect(column(-1, nodes_, table.addresses)));
    if (!experts_.empty()) {  // expert groups (forwards', backwards' per slot), in the order of their entries
      auto entry_of = [this](std::size_t i) {
        const auto [r, k] = slots_[i / 2];
        return expert_group_entry(k, r / ep_, d_ * t_ / ep_, /*backward=*/i % 2 == 1);
      };
      plan.ep_comms.resize(slots_.size());
      plan.ep_backward_comms.resize(slots_.size());
      for (const auto i : in_entry_order(experts_.size(), entry_of)) {
        const auto [r, k] = slots_[i / 2];
        const bool backward = i % 2 == 1;
        (backward ? plan.ep_backward_comms : plan.ep_comms)[i / 2] =
            group_comm(entry_of(i), r % ep_, ep_, *experts_[i],
                       "stage " + std::to_string(k) + "'s expert all-to-alls of " + (backward ? "backwards" : "forwards"));
      }
    }
    if (!expert_shards_.empty()) {
      auto entry_of = [this](std::size_t i) { return expert_shard_entry(slots_[i].second, slots_[i].first % ep_, ep_); };
      plan.edp_comms.resize(slots_.size());
      for (const auto i : in_entry_order(slots_.size(), entry_of)) {
        const auto [r, k] = slots_[i];
        plan.edp_comms[i] = group_comm(entry_of(i), r / ep_, d_ * t_ / ep_, *expert_shards_[i],
                                       "stage " + std::to_string(k) + "'s expert shard collectives");
        if (transport_.expert_shard_group > 0)
          plan.edp_comms[i] = transport::hybrid_shard_group(std::move(plan.edp_comms[i]), transport_.expert_shard_group,
                                                            transport::process_ucx_options().timeout);
      }
    }
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
  int node_, nodes_, d_, t_, ep_;
  int c_ = 1;  ///< context parallelism: in process where a group is whole on this node, else UCX
  /// The table's entry of slot (q, k)'s context-parallel group (spread over nodes).
  int context_entry(int q, int k) const {
    return context_group_entry(k, q / (t_ * c_) * t_ + q % t_, d_ / c_ * t_);
  }
  /// Whether every rank of slot (q, k)'s context-parallel group is on this node.
  bool whole_context_group_here(int q, int k) const {
    const int first = q / (t_ * c_) * (t_ * c_) + q % t_;  // its rank 0's pipeline
    for (int cp = 0; cp < c_; ++cp)
      if (std::find(slots_.begin(), slots_.end(), std::make_pair(first + cp * t_, k)) == slots_.end()) return false;
    return true;
  }
  /// The table's entry of the shard group of slot (pipeline q, stage k): its (stage,
  /// tensor-parallel rank).
  int shard_group(int q, int k) const { return k * t_ + q % t_; }
  /// Whether every rank of slot (q, k)'s tensor-parallel group is on this node.
  bool whole_group_here(int q, int k) const {
    for (int tp = 0; tp < t_; ++tp)
      if (std::find(slots_.begin(), slots_.end(), std::make_pair(q / t_ * t_ + tp, k)) == slots_.end()) return false;
    return true;
  }
  std::vector<std::pair<int, int>> slots_;
  node_transport transport_;
  std::string machine_;  // transport::machine_key(), sent with the addresses
  std::vector<std::unique_ptr<transport::ucx_pending>> pending_;  // per slot, then the world
  std::vector<std::unique_ptr<transport::ucx_pending>> experts_;  // per slot: its expert-parallel groups (EP > 1), forwards' and backwards'
  std::vector<std::unique_ptr<transport::ucx_pending>> expert_shards_;  // per slot: its shard's expert-data-parallel group (EP > 1)
  std::vector<std::unique_ptr<transport::ucx_pending>> tensors_;  // per slot whose tensor-parallel group spans nodes
  std::vector<std::unique_ptr<transport::ucx_pending>> contexts_;  // per slot whose context-parallel group spans nodes
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

}  // namespace

std::unique_ptr<comm_renewal> make_node_comms(int node, int nodes, int p, int d, int t, int ep, int c,
                                              std::vector<std::pair<int, int>> slots, node_transport transport) {
  return std::make_unique<ucx_renewal>(node, nodes, p, d, t, ep, c, std::move(slots), transport);
}

node_transport transport_for(const runtime_context& ctx, const node_transport_settings& settings,
                             const std::string& where) {
  using staging = node_transport::staging;
  using ipc_memory = node_transport::ipc_memory;
  node_transport t;
  const std::string& ipc = settings.ipc;
  if (settings.stage_through_host == "1") {
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
  if (ctx.g < ctx.d) t.shard_group = ctx.g;
  if (ctx.eg < ctx.edp) t.expert_shard_group = ctx.eg;
  const std::string& nccl = settings.nccl;
  if (nccl == "1") {
    if (!ctx.device.is_cuda()) throw config_error("TROUPE_NCCL=1: the job does not run on a GPU (--device cuda)");
    if (!transport::nccl_built()) throw config_error("TROUPE_NCCL=1: this build has no NCCL backend");
    spdlog::info("{}: TROUPE_NCCL=1: the optimizer shards' collectives, and the tensors between stages on different "
                 "nodes, go over NCCL where the nodes involved each have a GPU of their own (not yet run on GPUs: "
                 "see docs/gpu.md)", where);
    t.nccl = true;
  } else if (!nccl.empty() && nccl != "0") {
    throw config_error("TROUPE_NCCL=" + nccl + ": expected 1 or 0");
  }
  const std::string& links = settings.links;
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

}  // namespace troupe
