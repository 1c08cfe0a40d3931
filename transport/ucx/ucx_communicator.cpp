#include "transport/ucx/ucx_communicator.hpp"

#include <c10/core/GradMode.h>

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <atomic>
#include <deque>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>
#include <unordered_set>

#include <torch/torch.h>
#include <ucp/api/ucp.h>

#include "transport/algorithms/direct_exchange.hpp"
#include "transport/algorithms/ring.hpp"
#include "transport/torch_threads.hpp"

namespace troupe::transport {

namespace {

constexpr std::uint64_t collective_bit = 1ull << 63;
constexpr int src_shift = 48, kind_shift = 40, seq_shift = 16;
constexpr std::uint64_t src_mask = 0x7FFFull << src_shift;
constexpr std::uint64_t kind_mask = 0xFFull << kind_shift;
constexpr std::uint64_t full_mask = ~0ull;
constexpr int max_ranks = 0x7FFF;

std::uint64_t p2p_tag(int src, std::uint32_t tag) { return (std::uint64_t(src) << src_shift) | tag; }
std::uint64_t coll_tag(int src, collective kind, std::uint64_t seq, int step) {
  return collective_bit | (std::uint64_t(src) << src_shift) | (std::uint64_t(kind) << kind_shift) |
         ((seq & 0xFFFFFF) << seq_shift) | std::uint64_t(step & 0xFFFF);
}

// The communicator whose collective thread is driving its worker right now (set on that
// thread only, cleared while it is inside UCX: callbacks must not post directly).
thread_local const void* t_driver = nullptr;

void check_status(ucs_status_t s, const char* what) {
  if (s != UCS_OK) throw transport_error(std::string(what) + ": " + ucs_status_string(s));
}

struct pending_op;

// A published address: the worker's UCX address, then this machine's name and its length
// (one byte), so that every rank can count the ranks that share its machine.
std::string machine_name() {
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  return std::string(host).substr(0, 255);
}
std::string with_machine(const std::string& ucx_address) {
  const auto host = machine_name();
  return ucx_address + host + char(static_cast<unsigned char>(host.size()));
}
std::pair<std::string, std::string> split_address(const std::string& published) {
  const std::size_t len = published.empty() ? 0 : static_cast<unsigned char>(published.back());
  if (published.size() < len + 2)
    throw transport_error("malformed UCX address (" + std::to_string(published.size()) + " bytes)");
  const auto cut = published.size() - 1 - len;
  return {published.substr(0, cut), published.substr(cut, len)};
}

class ucx_comm : public communicator, public std::enable_shared_from_this<ucx_comm> {
 public:
  ucx_comm(int rank, int size, ucx_options opts) : rank_(rank), size_(size), opts_(opts) {}
  ~ucx_comm() override { shutdown(); }

  /// Phase 1: context, worker, own address.
  std::string init();
  /// Phase 2: endpoints to every rank, progress and collective threads.
  void connect(const std::vector<std::string>& all);

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "ucx"; }

  work_ptr send(torch::Tensor t, int dst, std::uint32_t tag) override {
    check_tensor(t, -1, "send");
    check_rank(dst);
    auto w = std::make_shared<work>("send to rank " + std::to_string(dst) + " tag " + std::to_string(tag));
    post_send(w, t, dst, p2p_tag(rank_, tag));
    return w;
  }
  work_ptr recv(torch::Tensor t, int src, std::uint32_t tag) override {
    check_tensor(t, -1, "recv");
    check_rank(src);
    auto w = std::make_shared<work>("recv from rank " + std::to_string(src) + " tag " + std::to_string(tag));
    post_recv(w, t, p2p_tag(src, tag), full_mask, 0);
    return w;
  }
  work_ptr all_reduce(torch::Tensor t) override;
  work_ptr reduce_scatter(torch::Tensor input, torch::Tensor output) override;
  work_ptr all_gather(torch::Tensor input, torch::Tensor output) override;
  work_ptr broadcast(torch::Tensor t, int root) override;
  void abort(const std::string& why) override;

  // Called on the progress thread by UCX callbacks.
  void finish(pending_op* op, ucs_status_t status, const ucp_tag_recv_info_t* info);
  void peer_failed(int peer, ucs_status_t status);

 private:
  void check_rank(int r) const {
    if (r < 0 || r >= size_) throw std::invalid_argument("rank " + std::to_string(r) + " outside the communicator");
  }
  void post(std::function<void()> cmd);
  /// Runs the queued commands (the caller holds worker_mu_); true if there were any.
  bool run_commands();
  /// The collective thread progresses the worker itself while a collective runs (where the
  /// progress loop spins anyway): its transfers start, and their completions are seen,
  /// without a hand-off to the progress thread and back (two thread wake-ups per step).
  bool drives() const { return opts_.drive && spin_ > 0; }  // only where the progress loop spins
  void begin_drive();
  void end_drive();
  void post_send(const work_ptr& w, torch::Tensor t, int dst, std::uint64_t tag);
  void post_recv(const work_ptr& w, torch::Tensor t, std::uint64_t tag, std::uint64_t mask, std::uint64_t check_kind);
  /// Queues a transfer for the progress thread; `start` fills the callback and posts it.
  void submit(const work_ptr& w, torch::Tensor t, std::size_t bytes, std::uint64_t check_kind,
              std::function<ucs_status_ptr_t(pending_op*, ucp_request_param_t&)> start);
  void posted(pending_op* op, ucs_status_ptr_t req);
  void progress_loop();
  void executor_loop();
  work_ptr enqueue(collective kind, std::function<void(std::uint64_t seq)> body);
  void shutdown();
  std::string broken() const {
    std::lock_guard<std::mutex> lock(mu_);
    return broken_;
  }

  // Blocking helpers for the collective thread.
  void await(const work_ptr& w);
  /// `meanwhile` runs once the transfers are under way (work that overlaps them).
  void ring_exchange(collective kind, std::uint64_t seq, int step, torch::Tensor send_t, int dst, torch::Tensor recv_t,
                     int src, const std::function<void()>& meanwhile = {});
  /// Sends to[p] to every other rank p and receives from[p] from it, all at once.
  void direct_exchange(collective kind, std::uint64_t seq, int step, const std::vector<torch::Tensor>& to,
                       const std::vector<torch::Tensor>& from, const std::function<void()>& meanwhile = {});
  /// Direct exchange rather than a ring (transport/algorithms/): small tensors on 3 ranks or more.
  bool direct(const torch::Tensor& t) const {
    return size_ >= 3 && std::int64_t(t.nbytes()) <= opts_.direct_max_bytes;
  }
  /// The algorithms' exchange steps over this communicator's tagged transfers.
  ring_exchange_fn ring_step() {
    return [this](collective k, std::uint64_t q, int s, torch::Tensor a, int d, torch::Tensor b, int src,
                  const std::function<void()>& meanwhile) { ring_exchange(k, q, s, a, d, b, src, meanwhile); };
  }
  all_exchange_fn direct_step() {
    return [this](collective k, std::uint64_t q, int s, const std::vector<torch::Tensor>& to,
                  const std::vector<torch::Tensor>& from,
                  const std::function<void()>& meanwhile) { direct_exchange(k, q, s, to, from, meanwhile); };
  }

  const int rank_, size_;
  const ucx_options opts_;
  int spin_ = 0;  // resolve_spin(opts_.spin, ranks on this machine), set by connect()
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::vector<ucp_ep_h> eps_;
  int epoll_fd_ = -1, wake_fd_ = -1, worker_fd_ = -1;

  mutable std::mutex mu_;
  std::deque<std::function<void()>> commands_;  // run by whoever holds worker_mu_
  std::mutex worker_mu_;                        // every call on the worker, and pending_
  std::unordered_set<pending_op*> pending_;
  std::atomic<bool> driving_{false};  // the collective thread holds the worker: the progress thread parks
  std::mutex park_mu_;
  std::condition_variable park_cv_;
  std::string broken_;
  std::atomic<bool> stop_{false};
  std::chrono::steady_clock::time_point stop_deadline_;  // set before stop_
  std::thread progress_;

  std::mutex exec_mu_;
  std::condition_variable exec_cv_;
  std::deque<std::function<void()>> jobs_;
  bool exec_stop_ = false;
  std::thread executor_;
  std::uint64_t seq_ = 0;  // next collective number (caller side, under exec_mu_)
  std::vector<std::pair<ucx_comm*, int>*> peers_args_;  // error-handler arguments
  std::vector<torch::Tensor> scratch_;                  // collective thread only
};

struct pending_op {
  ucx_comm* comm;
  work_ptr done;
  torch::Tensor keep;          // the tensor stays alive until the transfer is over
  std::size_t bytes = 0;       // receives: expected length
  std::uint64_t check_kind = 0;  // receives of collectives: expected kind bits
  void* request = nullptr;
  bool posting = true;    // UCX may call the callback before ucp_tag_*_nbx returns
  bool finished = false;  // ... then the poster frees the op
};

void send_cb(void* request, ucs_status_t status, void* user) {
  auto* op = static_cast<pending_op*>(user);
  op->comm->finish(op, status, nullptr);
  ucp_request_free(request);
}

void recv_cb(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info, void* user) {
  auto* op = static_cast<pending_op*>(user);
  op->comm->finish(op, status, info);
  ucp_request_free(request);
}

void ep_error_cb(void* arg, ucp_ep_h, ucs_status_t status) {
  auto* peer = static_cast<std::pair<ucx_comm*, int>*>(arg);
  peer->first->peer_failed(peer->second, status);
}

std::string kind_text(std::uint64_t tag) {
  return collective_name(collective((tag & kind_mask) >> kind_shift));
}

void ucx_comm::finish(pending_op* op, ucs_status_t status, const ucp_tag_recv_info_t* info) {
  pending_.erase(op);
  std::string error;
  if (status != UCS_OK) {
    error = status == UCS_ERR_MESSAGE_TRUNCATED ? std::string("size mismatch: the peer sent more than ") +
                                                      std::to_string(op->bytes) + " bytes"
                                                : std::string(ucs_status_string(status));
  } else if (info) {
    if (op->check_kind && (info->sender_tag & kind_mask) != op->check_kind)
      error = "collective order mismatch: rank " + std::to_string((info->sender_tag & src_mask) >> src_shift) +
              " called " + kind_text(info->sender_tag) + " where this rank called " + kind_text(op->check_kind);
    else if (info->length != op->bytes)
      error = "size mismatch: received " + std::to_string(info->length) + " bytes, expected " +
              std::to_string(op->bytes);
  }
  auto done = std::move(op->done);
  if (op->posting)
    op->finished = true;
  else
    delete op;
  done->complete(error);
}

void ucx_comm::peer_failed(int peer, ucs_status_t status) {
  const auto why = "rank " + std::to_string(peer) + " unreachable (" + ucs_status_string(status) + ")";
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (broken_.empty()) broken_ = why;
  }
  for (auto* op : std::vector<pending_op*>(pending_.begin(), pending_.end()))
    if (op->request) ucp_request_cancel(worker_, op->request);
}

std::string ucx_comm::init() {
  if (size_ < 1 || size_ > max_ranks || rank_ < 0 || rank_ >= size_)
    throw std::invalid_argument("ucx communicator: rank " + std::to_string(rank_) + " of " + std::to_string(size_));
  ucp_config_t* config = nullptr;
  check_status(ucp_config_read(nullptr, nullptr, &config), "ucp_config_read");
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
  const auto st = ucp_init(&params, config, &context_);
  ucp_config_release(config);
  check_status(st, "ucp_init");
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  // The progress thread, and the collective thread where it drives (under worker_mu_).
  wp.thread_mode = opts_.drive ? UCS_THREAD_MODE_SERIALIZED : UCS_THREAD_MODE_SINGLE;
  check_status(ucp_worker_create(context_, &wp, &worker_), "ucp_worker_create");
  ucp_address_t* addr = nullptr;
  std::size_t len = 0;
  check_status(ucp_worker_get_address(worker_, &addr, &len), "ucp_worker_get_address");
  const auto mine = with_machine(std::string(reinterpret_cast<const char*>(addr), len));
  ucp_worker_release_address(worker_, addr);
  return mine;
}

void ucx_comm::connect(const std::vector<std::string>& all) {
  if (int(all.size()) != size_)
    throw transport_error("address exchange returned " + std::to_string(all.size()) + " addresses for " +
                          std::to_string(size_) + " ranks");
  std::vector<std::string> ucx_addresses;
  int local = 0;
  const auto here = machine_name();
  for (const auto& a : all) {
    if (a.empty() && opts_.sparse) {  // a rank this one does not connect to
      ucx_addresses.emplace_back();
      continue;
    }
    auto [ucx_address, machine] = split_address(a);
    ucx_addresses.push_back(std::move(ucx_address));
    local += machine == here;
  }
  if (ucx_addresses.at(std::size_t(rank_)).empty())
    throw transport_error("address exchange gave rank " + std::to_string(rank_) + " no address of its own");
  spin_ = resolve_spin(opts_.spin, local, opts_.tls);
  eps_.assign(size_, nullptr);
  for (int r = 0; r < size_; ++r) {
    if (ucx_addresses[r].empty()) continue;
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.address = reinterpret_cast<const ucp_address_t*>(ucx_addresses[r].data());
    // UCX 1.13's shared-memory transports have no peer-failure handling: a dead peer is
    // noticed by the timeouts of the collectives and by the control plane (abort()).
    ep.err_mode = opts_.peer_failure_handling ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
    ep.err_handler.cb = ep_error_cb;
    ep.err_handler.arg = new std::pair<ucx_comm*, int>(this, r);  // freed in shutdown()
    check_status(ucp_ep_create(worker_, &ep, &eps_[r]), "ucp_ep_create");
    peers_args_.push_back(static_cast<std::pair<ucx_comm*, int>*>(ep.err_handler.arg));
  }
  check_status(ucp_worker_get_efd(worker_, &worker_fd_), "ucp_worker_get_efd");
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  for (int fd : {worker_fd_, wake_fd_}) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev) != 0) throw transport_error("epoll_ctl failed");
  }
  progress_ = std::thread([this] { progress_loop(); });
  executor_ = std::thread([this] { executor_loop(); });
}

void ucx_comm::post(std::function<void()> cmd) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    commands_.push_back(std::move(cmd));
  }
  const std::uint64_t one = 1;
  [[maybe_unused]] auto n = ::write(wake_fd_, &one, sizeof one);
}

void ucx_comm::submit(const work_ptr& w, torch::Tensor t, std::size_t bytes, std::uint64_t check_kind,
                      std::function<ucs_status_ptr_t(pending_op*, ucp_request_param_t&)> start) {
  if (auto b = broken(); !b.empty()) return w->complete("communicator aborted: " + b);
  auto* op = new pending_op{this, w, std::move(t), bytes, check_kind, nullptr};
  auto begin = [this, op, start = std::move(start)] {
    // (An abort between the check above and this command: its sweep ran first.)
    if (auto b = broken(); !b.empty()) {
      op->done->complete("communicator aborted: " + b);
      delete op;
      return;
    }
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
    p.user_data = op;
    pending_.insert(op);
    posted(op, start(op, p));
  };
  if (t_driver != this) return post(std::move(begin));
  std::lock_guard<std::mutex> wl(worker_mu_);
  t_driver = nullptr;
  begin();
  t_driver = this;
}

bool ucx_comm::run_commands() {
  std::deque<std::function<void()>> cmds;
  {
    std::lock_guard<std::mutex> lock(mu_);
    cmds.swap(commands_);
  }
  for (auto& c : cmds) c();
  return !cmds.empty();
}

void ucx_comm::begin_drive() {
  if (!drives()) return;
  driving_ = true;
  t_driver = this;
}

void ucx_comm::end_drive() {
  if (t_driver != this) return;
  t_driver = nullptr;
  {
    std::lock_guard<std::mutex> lock(park_mu_);
    driving_ = false;
  }
  park_cv_.notify_one();
  post([] {});  // and out of epoll_wait, if it slept there when the drive began
}

void ucx_comm::post_send(const work_ptr& w, torch::Tensor t, int dst, std::uint64_t tag) {
  if (!eps_[dst])
    return w->complete("rank " + std::to_string(rank_) + " is not connected to rank " + std::to_string(dst) +
                       " (it was given no address of it: the communicator connects some ranks only)");
  submit(w, std::move(t), 0, 0, [this, dst, tag](pending_op* op, ucp_request_param_t& p) {
    p.cb.send = send_cb;
    return ucp_tag_send_nbx(eps_[dst], op->keep.data_ptr(), op->keep.nbytes(), tag, &p);
  });
}

void ucx_comm::post_recv(const work_ptr& w, torch::Tensor t, std::uint64_t tag, std::uint64_t mask,
                         std::uint64_t check_kind) {
  const auto bytes = t.nbytes();
  submit(w, std::move(t), bytes, check_kind, [this, tag, mask](pending_op* op, ucp_request_param_t& p) {
    p.cb.recv = recv_cb;
    return ucp_tag_recv_nbx(worker_, op->keep.data_ptr(), op->bytes, tag, mask, &p);
  });
}

void ucx_comm::posted(pending_op* op, ucs_status_ptr_t req) {
  op->posting = false;
  if (UCS_PTR_IS_ERR(req)) return finish(op, UCS_PTR_STATUS(req), nullptr);
  if (op->finished)
    delete op;
  else
    op->request = req;
}

void ucx_comm::progress_loop() {
  c10::AutoGradMode no_grad(false);  // tensors here are data (see executor_loop)
  compute_on_one_intra_op_thread();
  int idle = 0;
  while (true) {
    if (driving_) {
      std::unique_lock<std::mutex> lock(park_mu_);
      park_cv_.wait_for(lock, std::chrono::milliseconds(100), [this] { return !driving_ || stop_; });
      idle = 0;
      continue;
    }
    std::unique_lock<std::mutex> wl(worker_mu_);
    const bool ran = run_commands();
    // Sends to a dead peer never complete (UCX cannot cancel them): stop waiting after a
    // grace period; shutdown() fails what is left.
    if (stop_ && (pending_.empty() || std::chrono::steady_clock::now() > stop_deadline_)) break;
    if (ucp_worker_progress(worker_) != 0 || ran) {
      idle = 0;
      continue;
    }
    // While transfers are pending a peer is about to answer: keep polling (yielding the
    // core to the other processes of the machine) rather than pay a wake-up per message.
    if (++idle < spin_ || (!pending_.empty() && idle < 64 * spin_)) {
      wl.unlock();
      if (idle > 64) std::this_thread::yield();
      continue;
    }
    idle = 0;
    if (ucp_worker_arm(worker_) == UCS_ERR_BUSY) continue;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!commands_.empty()) continue;
    }
    wl.unlock();
    epoll_event evs[2];
    epoll_wait(epoll_fd_, evs, 2, stop_ ? 10 : 200);
    std::uint64_t drained;
    [[maybe_unused]] auto n = ::read(wake_fd_, &drained, sizeof drained);
  }
}

void ucx_comm::executor_loop() {
  // Tensors are data to the transport: writing into a caller's view (made without grad
  // mode, as inside a custom autograd function) must not be recorded by the autograd.
  c10::AutoGradMode no_grad(false);
  compute_on_one_intra_op_thread();  // (the ring's sums)
  while (true) {
    std::function<void()> job;
    {
      std::unique_lock<std::mutex> lock(exec_mu_);
      exec_cv_.wait(lock, [this] { return exec_stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    job();
  }
}

work_ptr ucx_comm::enqueue(collective kind, std::function<void(std::uint64_t)> body) {
  std::lock_guard<std::mutex> lock(exec_mu_);
  const auto seq = seq_++;
  auto w = std::make_shared<work>(std::string(collective_name(kind)) + " #" + std::to_string(seq) + " (rank " +
                                  std::to_string(rank_) + " of " + std::to_string(size_) + ")");
  jobs_.push_back([this, w, seq, body = std::move(body)] {
    if (auto b = broken(); !b.empty()) return w->complete("communicator aborted: " + b);
    begin_drive();
    try {
      body(seq);
      end_drive();
      w->complete();
    } catch (const std::exception& e) {
      end_drive();
      w->complete(e.what());
    }
  });
  exec_cv_.notify_one();
  return w;
}

void ucx_comm::ring_exchange(collective kind, std::uint64_t seq, int step, torch::Tensor send_t, int dst,
                             torch::Tensor recv_t, int src, const std::function<void()>& meanwhile) {
  const auto k = std::uint64_t(kind) << kind_shift;
  work_ptr r, s;
  if (recv_t.defined() && recv_t.numel() > 0) {
    r = std::make_shared<work>(std::string(collective_name(kind)) + " #" + std::to_string(seq) + " step " +
                               std::to_string(step) + ": receive from rank " + std::to_string(src));
    post_recv(r, recv_t, coll_tag(src, kind, seq, step), full_mask & ~kind_mask, k);
  }
  if (send_t.defined() && send_t.numel() > 0) {
    s = std::make_shared<work>(std::string(collective_name(kind)) + " #" + std::to_string(seq) + " step " +
                               std::to_string(step) + ": send to rank " + std::to_string(dst));
    post_send(s, send_t, dst, coll_tag(rank_, kind, seq, step));
  }
  if (meanwhile) meanwhile();
  for (auto& w : {r, s})
    if (w) await(w);
}

void ucx_comm::direct_exchange(collective kind, std::uint64_t seq, int step, const std::vector<torch::Tensor>& to,
                               const std::vector<torch::Tensor>& from, const std::function<void()>& meanwhile) {
  const auto k = std::uint64_t(kind) << kind_shift;
  const auto name = std::string(collective_name(kind)) + " #" + std::to_string(seq) + " step " + std::to_string(step);
  std::vector<work_ptr> ws;
  for (int p = 0; p < size_; ++p) {
    if (p == rank_ || !from[p].defined() || from[p].numel() == 0) continue;
    ws.push_back(std::make_shared<work>(name + ": receive from rank " + std::to_string(p)));
    post_recv(ws.back(), from[p], coll_tag(p, kind, seq, step), full_mask & ~kind_mask, k);
  }
  for (int p = 0; p < size_; ++p) {
    if (p == rank_ || !to[p].defined() || to[p].numel() == 0) continue;
    ws.push_back(std::make_shared<work>(name + ": send to rank " + std::to_string(p)));
    post_send(ws.back(), to[p], p, coll_tag(rank_, kind, seq, step));
  }
  if (meanwhile) meanwhile();
  for (auto& w : ws) await(w);
}

void ucx_comm::await(const work_ptr& w) {
  // Driving: progress here until the transfer is done, with the progress loop's patience
  // (then hand the worker back and sleep on the work like any other waiter).
  for (int idle = 0; t_driver == this && !w->done();) {
    bool moved;
    {
      std::lock_guard<std::mutex> wl(worker_mu_);
      t_driver = nullptr;
      moved = run_commands();
      moved = ucp_worker_progress(worker_) != 0 || moved;
      t_driver = this;
    }
    if (moved)
      idle = 0;
    else if (++idle >= 64 * spin_)
      end_drive();
    else if (idle > 64)
      std::this_thread::yield();
  }
  try {
    w->wait_or_throw(opts_.timeout);
  } catch (const transport_error& e) {
    abort(e.what());  // the ranks are out of step now: the communicator is unusable
    throw;
  }
}

work_ptr ucx_comm::all_reduce(torch::Tensor t) {
  check_tensor(t, -1, "all_reduce");
  if (!summable(t.scalar_type())) throw std::invalid_argument("all_reduce: dtype cannot be summed");
  return enqueue(collective::all_reduce, [this, t](std::uint64_t seq) {
    auto flat = t.view({-1});
    auto [b, e] = piece(flat.numel(), size_, rank_);
    if (direct(flat)) {
      direct_reduce_scatter(rank_, size_, collective::all_reduce, seq, flat, flat.narrow(0, b, e - b), scratch_,
                            direct_step());
      return direct_all_gather(rank_, size_, collective::all_reduce, seq, 1, flat, torch::Tensor(), direct_step());
    }
    // The sum of piece `rank` can land in place: no step before the last reads it.
    ring_reduce_scatter(rank_, size_, collective::all_reduce, seq, 0, flat, flat.narrow(0, b, e - b), scratch_,
                        ring_step());
    ring_all_gather(rank_, size_, collective::all_reduce, seq, size_ - 1, flat, torch::Tensor(), ring_step());
  });
}

work_ptr ucx_comm::reduce_scatter(torch::Tensor input, torch::Tensor output) {
  check_tensor(input, -1, "reduce_scatter input");
  if (!summable(input.scalar_type())) throw std::invalid_argument("reduce_scatter: dtype cannot be summed");
  auto [b, e] = piece(input.numel(), size_, rank_);
  check_tensor(output, e - b, "reduce_scatter output");
  return enqueue(collective::reduce_scatter, [this, input, output](std::uint64_t seq) {
    if (direct(input))
      return direct_reduce_scatter(rank_, size_, collective::reduce_scatter, seq, input.view({-1}), output.view({-1}),
                                   scratch_, direct_step());
    ring_reduce_scatter(rank_, size_, collective::reduce_scatter, seq, 0, input.view({-1}), output.view({-1}), scratch_,
                        ring_step());
  });
}

work_ptr ucx_comm::all_gather(torch::Tensor input, torch::Tensor output) {
  check_tensor(output, -1, "all_gather output");
  auto [b, e] = piece(output.numel(), size_, rank_);
  check_tensor(input, e - b, "all_gather input");
  return enqueue(collective::all_gather, [this, input, output, b = b, e = e](std::uint64_t seq) {
    auto flat = output.view({-1});
    // The own piece is sent from the input and copied into place while the first
    // transfers run; an input inside the output is copied first (or not at all: it is
    // the own piece already), since the other pieces are received into the output.
    auto mine = input.view({-1});
    auto slot = flat.narrow(0, b, e - b);
    const auto* lo = static_cast<const char*>(flat.data_ptr());
    const auto* at = static_cast<const char*>(mine.data_ptr());
    if (at >= lo && at < lo + flat.nbytes()) {
      if (mine.data_ptr() != slot.data_ptr()) slot.copy_(mine);
      mine = torch::Tensor();
    }
    if (direct(flat)) return direct_all_gather(rank_, size_, collective::all_gather, seq, 0, flat, mine, direct_step());
    ring_all_gather(rank_, size_, collective::all_gather, seq, 0, flat, mine, ring_step());
  });
}

work_ptr ucx_comm::broadcast(torch::Tensor t, int root) {
  check_tensor(t, -1, "broadcast");
  check_rank(root);
  // A chain root -> root+1 -> ... in segments, so that every link carries data at once.
  return enqueue(collective::broadcast, [this, t, root](std::uint64_t seq) {
    auto flat = t.view({-1});
    const std::int64_t seg_bytes = std::max<std::int64_t>(1 << 20, std::int64_t(t.nbytes()) / 60000 + 1);
    const std::int64_t seg = std::max<std::int64_t>(1, seg_bytes / std::max<std::int64_t>(1, t.element_size()));
    const int pos = (rank_ - root + size_) % size_;
    const int next = (rank_ + 1) % size_, prev = (rank_ + size_ - 1) % size_;
    // Receive segment k, then forward it while segment k+1 arrives.
    std::vector<work_ptr> sends;
    int step = 0;
    for (std::int64_t b = 0; b < flat.numel(); b += seg, ++step) {
      auto part = flat.narrow(0, b, std::min(seg, flat.numel() - b));
      if (pos > 0) ring_exchange(collective::broadcast, seq, step, torch::Tensor(), next, part, prev);
      if (pos + 1 < size_) {
        sends.push_back(std::make_shared<work>("broadcast #" + std::to_string(seq) + " step " + std::to_string(step) +
                                               ": send to rank " + std::to_string(next)));
        post_send(sends.back(), part, next, coll_tag(rank_, collective::broadcast, seq, step));
      }
    }
    for (auto& w : sends) await(w);
  });
}

void ucx_comm::abort(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (broken_.empty()) broken_ = why;
  }
  // Receives not yet matched are cancelled; sends cannot be (UCX 1.13), nor a receive
  // already under way, and one with a peer that died or froze would never complete:
  // every pending transfer's work fails now, naming the abort, so that no caller waits on
  // it (point-to-point and all-to-all callers wait without a deadline). The op itself
  // stays pending: its request and tensor belong to UCX until the request ends or
  // shutdown() frees them, so a receive under way may still write into its tensor (the
  // callers drop what an aborted transfer was to fill: a retry makes fresh buffers). The
  // work is failed before the cancel, whose callback may free the op.
  post([this] {
    const auto why = "communicator aborted: " + broken();
    for (auto* op : std::vector<pending_op*>(pending_.begin(), pending_.end())) {
      if (op->done) op->done->complete(why);
      if (op->request) ucp_request_cancel(worker_, op->request);
    }
  });
}

void ucx_comm::shutdown() {
  const bool failed_before = !broken().empty();
  if (progress_.joinable()) abort("communicator closed");
  {
    std::lock_guard<std::mutex> lock(exec_mu_);
    exec_stop_ = true;
  }
  exec_cv_.notify_all();
  if (executor_.joinable()) executor_.join();
  if (progress_.joinable()) {
    // (abort() above cancelled what was pending; nothing is posted after it.)
    stop_deadline_ = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    stop_ = true;
    post([] {});
    progress_.join();
  }
  // Whatever is still pending (sends to a peer that is gone) fails now; the requests go
  // with the worker, the ops after it.
  std::vector<pending_op*> leftover(pending_.begin(), pending_.end());
  pending_.clear();
  for (auto* op : leftover) {
    auto done = std::move(op->done);
    if (done) done->complete("communicator closed with the transfer pending");
  }
  const bool peers_gone = failed_before || !leftover.empty();
  for (auto& ep : eps_) {
    if (!ep) continue;
    // Flush first (sends that completed locally may still be on their way), bounded in
    // time; after a failure, force (a peer that is gone would never answer the flush).
    ucp_request_param_t p{};
    if (peers_gone) {
      p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      p.flags = UCP_EP_CLOSE_FLAG_FORCE;
    }
    auto req = ucp_ep_close_nbx(ep, &p);
    if (UCS_PTR_IS_PTR(req)) {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
      while (ucp_request_check_status(req) == UCS_INPROGRESS && std::chrono::steady_clock::now() < deadline)
        ucp_worker_progress(worker_);
      if (ucp_request_check_status(req) == UCS_INPROGRESS) ucp_request_cancel(worker_, req);
      ucp_request_free(req);
    }
    ep = nullptr;
  }
  for (auto* a : peers_args_) delete a;
  peers_args_.clear();
  if (epoll_fd_ >= 0) ::close(epoll_fd_);
  if (wake_fd_ >= 0) ::close(wake_fd_);
  epoll_fd_ = wake_fd_ = -1;
  if (worker_) ucp_worker_destroy(worker_);
  for (auto* op : leftover) delete op;
  if (context_) ucp_cleanup(context_);
  worker_ = nullptr;
  context_ = nullptr;
}

}  // namespace

namespace {
class pending_impl : public ucx_pending {
 public:
  pending_impl(int rank, int size, ucx_options opts) : comm_(std::make_shared<ucx_comm>(rank, size, opts)) {
    address_ = comm_->init();
  }
  const std::string& address() const override { return address_; }
  std::shared_ptr<communicator> connect(const std::vector<std::string>& addresses) override {
    if (!comm_) throw std::logic_error("ucx_pending::connect called twice");
    comm_->connect(addresses);
    return std::move(comm_);
  }

 private:
  std::shared_ptr<ucx_comm> comm_;
  std::string address_;
};
}  // namespace

int resolve_spin(int requested, int local_ranks, const std::string& tls) {
  if (requested >= 0) return requested;
  // UCX_TLS naming tcp and nothing else but self (or "^..." exclusions: not TCP-only).
  if (tls.empty() || tls.front() == '^') return 2000;
  bool tcp = false, other = false;
  std::stringstream in(tls);
  for (std::string t; std::getline(in, t, ',');) (t == "tcp" ? tcp : other) |= t != "self";
  if (!tcp || other) return 2000;
  const int cores = std::max(1, int(std::thread::hardware_concurrency()));
  return local_ranks > cores ? 0 : 2000;
}

namespace {
ucx_options process_options;  // set_process_ucx_options (launch/, before any communicator)
}  // namespace

void set_process_ucx_options(const ucx_options& opts) { process_options = opts; }
const ucx_options& process_ucx_options() { return process_options; }

std::unique_ptr<ucx_pending> prepare_ucx_communicator(int rank, int size, ucx_options opts) {
  return std::make_unique<pending_impl>(rank, size, opts);
}

std::shared_ptr<communicator> make_ucx_communicator(int rank, int size, const address_exchange& exchange,
                                                    ucx_options opts) {
  auto pending = prepare_ucx_communicator(rank, size, opts);
  return pending->connect(exchange(pending->address()));
}

address_exchange folder_exchange(std::string dir, int rank, int size, std::chrono::milliseconds timeout) {
  return [dir, rank, size, timeout](const std::string& mine) {
    namespace fs = std::filesystem;
    fs::create_directories(dir);
    const auto tmp = fs::path(dir) / (std::to_string(rank) + ".tmp");
    {
      std::ofstream out(tmp, std::ios::binary);
      out.write(mine.data(), std::streamsize(mine.size()));
      if (!out) throw transport_error("cannot write " + tmp.string());
    }
    fs::rename(tmp, fs::path(dir) / std::to_string(rank));
    std::vector<std::string> all(size);
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (int r = 0; r < size; ++r) {
      const auto path = fs::path(dir) / std::to_string(r);
      while (!fs::exists(path)) {
        if (std::chrono::steady_clock::now() > deadline)
          throw transport_error("address exchange in " + dir + ": rank " + std::to_string(r) + " did not appear within " +
                                std::to_string(timeout.count()) + " ms");
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      std::ifstream in(path, std::ios::binary);
      std::ostringstream ss;
      ss << in.rdbuf();
      all[r] = ss.str();
    }
    return all;
  };
}

std::vector<std::string> ucx_memory_types() {
  ucp_config_t* config = nullptr;
  check_status(ucp_config_read(nullptr, nullptr, &config), "ucp_config_read");
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_TAG;
  ucp_context_h context = nullptr;
  const auto st = ucp_init(&params, config, &context);
  ucp_config_release(config);
  check_status(st, "ucp_init");
  ucp_context_attr_t attr{};
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  const auto q = ucp_context_query(context, &attr);
  ucp_cleanup(context);
  check_status(q, "ucp_context_query");
  std::vector<std::string> names;
  for (int t = 0; t < UCS_MEMORY_TYPE_LAST; ++t)
    if (attr.memory_types & UCS_BIT(t)) names.emplace_back(ucs_memory_type_names[t]);
  return names;
}

}  // namespace troupe::transport
