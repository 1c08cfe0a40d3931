#include "transport/ipc/ipc.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <stdexcept>
#include <thread>
#include <utility>

#include <torch/torch.h>

namespace troupe::transport {

namespace {

constexpr std::uint32_t kMagic = 0x54524950;   // a control message of this protocol
constexpr std::uint32_t kAckBit = 1u << 31;    // tags of acknowledgements: the buffer's id
constexpr std::int64_t kMessageBytes = 256;    // control messages and acknowledgements
constexpr std::size_t kGranule = 64 << 10;     // buffer sizes are multiples of this

struct control_header {
  std::uint32_t magic;
  std::uint32_t buffer;
  std::uint64_t nbytes;
  std::uint32_t handle_bytes;
};
constexpr std::size_t kMaxHandle = kMessageBytes - sizeof(control_header);

torch::Tensor message() { return torch::zeros({kMessageBytes}, torch::kUInt8); }

/// An acknowledgement's text (empty: the receiver copied the bytes).
std::string ack_text(const torch::Tensor& ack) {
  const char* p = reinterpret_cast<const char*>(ack.data_ptr());
  return std::string(p, strnlen(p, kMessageBytes));
}

struct out_buffer {
  std::uint32_t id = 0;
  std::unique_ptr<ipc_export> exported;
  bool busy = false;
};

/// One receive through a mapped buffer.
struct recv_op {
  work_ptr w;
  work_ptr control_work;
  torch::Tensor dst, control;
  std::shared_ptr<ipc_fence> fence;
  int src = 0;
  std::mutex mu;
  bool aborted = false;                  // by its caller: nothing is written after that
  std::shared_ptr<ipc_import> copying;   // the buffer a started copy reads
  std::uint32_t buffer = 0;
  std::atomic<bool> acknowledged{false};
};

/// The communicator's state. Its callbacks hold it weakly: only the communicator owns it
/// (and with it `inner`), so it goes on the communicator's thread, not on one of
/// `inner`'s threads from inside a callback.
struct core : std::enable_shared_from_this<core> {
  std::shared_ptr<communicator> inner;
  std::shared_ptr<ipc_memory> memory;
  std::vector<bool> same;
  ipc_options opts;

  std::mutex mu;
  std::vector<std::vector<std::shared_ptr<out_buffer>>> out;           // by peer
  std::vector<std::map<std::uint32_t, std::shared_ptr<ipc_import>>> in;  // by peer, by buffer id
  std::vector<std::uint32_t> next_id;
  std::deque<std::shared_ptr<recv_op>> copying;  // copies not finished when started (polled)
  int acks_in_flight = 0;
  std::condition_variable cv;
  bool stop = false;
  std::thread poller;

  /// A free buffer for `bytes` to `peer` (the smallest that fits; a new one if none).
  std::shared_ptr<out_buffer> take_buffer(int peer, std::size_t bytes) {
    std::lock_guard<std::mutex> lock(mu);
    std::shared_ptr<out_buffer> best;
    for (auto& b : out[peer])
      if (!b->busy && b->exported->capacity() >= bytes && (!best || b->exported->capacity() < best->exported->capacity()))
        best = b;
    if (!best) {
      best = std::make_shared<out_buffer>();
      best->id = next_id[peer]++;
      if (best->id >= kAckBit) throw transport_error("ipc: too many buffers to rank " + std::to_string(peer));
      best->exported = memory->allocate((bytes + kGranule - 1) / kGranule * kGranule);
      if (best->exported->handle().size() > kMaxHandle)
        throw transport_error("ipc: a " + memory->name() + " handle of " +
                              std::to_string(best->exported->handle().size()) + " bytes does not fit a message");
      out[peer].push_back(best);
    }
    best->busy = true;
    return best;
  }

  /// Tells the sender of `op` it may reuse the buffer (`problem`: why nothing was copied).
  void acknowledge(int src, std::uint32_t buffer, const std::string& problem) {
    auto ack = message();
    std::memcpy(ack.data_ptr(), problem.data(), std::min<std::size_t>(problem.size(), kMessageBytes - 1));
    {
      std::lock_guard<std::mutex> lock(mu);
      ++acks_in_flight;
    }
    inner->send(ack, src, kAckBit | buffer)->on_complete([me = weak_from_this(), ack](const std::string&) {
      if (auto c = me.lock()) {  // (gone: failed by `inner` going with the core)
        {
          std::lock_guard<std::mutex> lock(c->mu);
          --c->acks_in_flight;
        }
        c->cv.notify_all();
      }
    });
  }

  /// Waits (up to `grace`) for the acknowledgements on their way: a peer's send completes
  /// only with its acknowledgement.
  void drain(std::chrono::milliseconds grace) {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait_for(lock, grace, [&] { return acks_in_flight == 0; });
  }

  /// The copy of `op` is done: acknowledge once, complete its work.
  void finish(const std::shared_ptr<recv_op>& op, const std::string& error = {}) {
    if (!op->acknowledged.exchange(true)) acknowledge(op->src, op->buffer, error);
    op->w->complete(error);
  }

  void on_control(const std::shared_ptr<recv_op>& op, const std::string& err) {
    if (!err.empty()) {
      std::lock_guard<std::mutex> lock(op->mu);
      if (!op->aborted) op->w->complete(err);
      return;
    }
    control_header h;
    std::memcpy(&h, op->control.data_ptr(), sizeof h);
    if (h.magic != kMagic || h.handle_bytes > kMaxHandle) {
      op->w->complete("ipc recv: the message from rank " + std::to_string(op->src) +
                      " is not a control message of the ipc transport (does the sender use one?)");
      return;
    }
    op->buffer = h.buffer;
    std::string problem;
    if (h.nbytes != std::uint64_t(op->dst.nbytes()))
      problem = "rank " + std::to_string(op->src) + " sent " + std::to_string(h.nbytes) + " bytes, the receive takes " +
                std::to_string(op->dst.nbytes());
    std::shared_ptr<ipc_import> buf;
    if (problem.empty()) {
      {
        std::lock_guard<std::mutex> lock(mu);
        auto it = in[op->src].find(h.buffer);
        if (it != in[op->src].end()) buf = it->second;
      }
      if (!buf) try {
          const char* p = reinterpret_cast<const char*>(op->control.data_ptr()) + sizeof h;
          buf = memory->open(std::string(p, h.handle_bytes));
          std::lock_guard<std::mutex> lock(mu);
          in[op->src][h.buffer] = buf;
        } catch (const std::exception& e) {
          problem = std::string("cannot map the buffer of rank ") + std::to_string(op->src) + ": " + e.what();
        }
    }
    bool done = false;
    if (problem.empty()) {
      std::lock_guard<std::mutex> lock(op->mu);
      if (op->aborted) {
        problem = "the receive was aborted";
      } else {
        try {
          buf->start_copy_out(op->dst, op->fence.get());
          op->copying = buf;
          done = buf->copy_done();
        } catch (const std::exception& e) {
          problem = std::string("copying out of the shared buffer: ") + e.what();
        }
      }
    }
    if (!problem.empty()) return finish(op, "ipc recv: " + problem);
    if (done) return finish(op);
    std::unique_lock<std::mutex> lock(mu);
    if (stop) {  // closing: no poller any more
      lock.unlock();
      buf->wait_copy();
      return finish(op, "communicator closed");
    }
    copying.push_back(op);
    if (!poller.joinable()) poller = std::thread([this] { poll(); });
    lock.unlock();
    cv.notify_all();
  }

  /// Completes receives whose copies finish after they started (GPU copies).
  void poll() {
    std::unique_lock<std::mutex> lock(mu);
    while (!stop) {
      if (copying.empty()) {
        cv.wait(lock, [&] { return stop || !copying.empty(); });
        continue;
      }
      auto pending = copying;
      copying.clear();
      lock.unlock();
      std::vector<std::shared_ptr<recv_op>> later;
      for (auto& op : pending) {
        try {
          if (op->copying->copy_done()) finish(op);
          else later.push_back(op);
        } catch (const std::exception& e) {
          finish(op, std::string("ipc recv: copying out of the shared buffer: ") + e.what());
        }
      }
      std::this_thread::sleep_for(std::chrono::microseconds(later.empty() ? 0 : 20));
      lock.lock();
      copying.insert(copying.begin(), later.begin(), later.end());
    }
  }

  /// Stops the poller; copies still running are waited for and their works failed.
  void close(const std::string& why) {
    std::deque<std::shared_ptr<recv_op>> left;
    {
      std::lock_guard<std::mutex> lock(mu);
      stop = true;
    }
    cv.notify_all();
    if (poller.joinable()) poller.join();
    {
      std::lock_guard<std::mutex> lock(mu);
      left.swap(copying);
    }
    for (auto& op : left) {
      try {
        op->copying->wait_copy();
      } catch (const std::exception&) {
      }
      op->w->complete(why);
    }
  }
};

class ipc_communicator final : public communicator {
 public:
  ipc_communicator(std::shared_ptr<communicator> inner, std::shared_ptr<ipc_memory> memory, std::vector<bool> same,
                   ipc_options opts)
      : c_(std::make_shared<core>()) {
    const int n = inner->size();
    if (int(same.size()) != n)
      throw std::invalid_argument("ipc: " + std::to_string(same.size()) + " machine flags for " + std::to_string(n) +
                                  " ranks");
    same[inner->rank()] = false;  // a process cannot map its own handles (CUDA): to itself over `inner`
    c_->inner = std::move(inner);
    c_->memory = std::move(memory);
    c_->same = std::move(same);
    c_->opts = opts;
    c_->out.resize(n);
    c_->in.resize(n);
    c_->next_id.assign(n, 1);
  }
  ~ipc_communicator() override {
    // Acknowledgements already sent may finish; what still waits for a peer fails.
    c_->drain(std::chrono::seconds(2));
    c_->inner->abort("communicator closed");
    c_->close("communicator closed");
    // A callback running now holds the core for a moment: let it go before the core (and
    // `inner`, whose threads run the callbacks) is destroyed here.
    for (int i = 0; i < 10000 && c_.use_count() > 1; ++i) std::this_thread::sleep_for(std::chrono::microseconds(100));
  }

  int rank() const override { return c_->inner->rank(); }
  int size() const override { return c_->inner->size(); }
  std::string backend() const override {
    return c_->inner->backend() + " (point-to-point on this machine through " + c_->memory->name() + ")";
  }

  work_ptr send(torch::Tensor t, int dst, std::uint32_t tag) override {
    if (!mapped(t, dst, tag, "send")) return c_->inner->send(std::move(t), dst, tag);
    auto fence = c_->memory->fence(t);
    auto buf = c_->take_buffer(dst, t.nbytes());
    try {
      buf->exported->copy_in(t, fence.get());
    } catch (...) {
      std::lock_guard<std::mutex> lock(c_->mu);
      buf->busy = false;
      throw;
    }
    auto control = message();
    const auto& handle = buf->exported->handle();
    control_header h{kMagic, buf->id, std::uint64_t(t.nbytes()), std::uint32_t(handle.size())};
    std::memcpy(control.data_ptr(), &h, sizeof h);
    std::memcpy(static_cast<char*>(control.data_ptr()) + sizeof h, handle.data(), handle.size());

    auto w = std::make_shared<work>("ipc send");
    auto aborted = std::make_shared<std::atomic<bool>>(false);
    auto ack = message();
    auto ack_work = c_->inner->recv(ack, dst, kAckBit | buf->id);
    auto control_work = c_->inner->send(control, dst, tag);
    control_work->on_complete([w, control, aborted](const std::string& err) {
      if (!err.empty() && !*aborted) w->complete("control message: " + err);
    });
    // The peer may still read a buffer whose acknowledgement never came: it stays busy.
    ack_work->on_complete([w, ack, buf, aborted, me = std::weak_ptr<core>(c_), keep = t](const std::string& err) {
      if (*aborted) return;
      if (!err.empty()) return w->complete(err);
      const auto problem = ack_text(ack);
      if (auto c = me.lock()) {
        std::lock_guard<std::mutex> lock(c->mu);
        buf->busy = false;
      }
      w->complete(problem.empty() ? "" : "the receiver took nothing: " + problem);
    });
    w->set_abort_hook([aborted, control_work, ack_work] {
      *aborted = true;
      control_work->abort("its caller aborted the ipc send");
      ack_work->abort("its caller aborted the ipc send");
    });
    return w;
  }

  work_ptr recv(torch::Tensor t, int src, std::uint32_t tag) override {
    if (!mapped(t, src, tag, "recv")) return c_->inner->recv(std::move(t), src, tag);
    auto op = std::make_shared<recv_op>();
    op->w = std::make_shared<work>("ipc recv");
    op->dst = t;
    op->src = src;
    op->fence = c_->memory->fence(t);
    op->control = message();
    op->control_work = c_->inner->recv(op->control, src, tag);
    op->w->set_abort_hook([op] {
      std::shared_ptr<ipc_import> copying;
      {
        std::lock_guard<std::mutex> lock(op->mu);
        op->aborted = true;
        copying = op->copying;
      }
      op->control_work->abort("its caller aborted the ipc recv");
      if (copying) copying->wait_copy();  // nothing written after abort() returns
    });
    op->control_work->on_complete([me = std::weak_ptr<core>(c_), op](const std::string& err) {
      if (auto c = me.lock()) return c->on_control(op, err);
      op->w->complete("communicator closed");
    });
    return op->w;
  }

  work_ptr all_reduce(torch::Tensor t) override { return c_->inner->all_reduce(std::move(t)); }
  work_ptr reduce_scatter(torch::Tensor input, torch::Tensor output) override {
    return c_->inner->reduce_scatter(std::move(input), std::move(output));
  }
  work_ptr all_gather(torch::Tensor input, torch::Tensor output) override {
    return c_->inner->all_gather(std::move(input), std::move(output));
  }
  work_ptr broadcast(torch::Tensor t, int root) override { return c_->inner->broadcast(std::move(t), root); }

  void abort(const std::string& why) override {
    c_->inner->abort(why);  // fails every control message and acknowledgement in flight
    std::deque<std::shared_ptr<recv_op>> copying;
    {
      std::lock_guard<std::mutex> lock(c_->mu);
      copying.swap(c_->copying);
    }
    for (auto& op : copying) op->w->abort(why);
  }

 private:
  /// True when `t` goes through a mapped buffer (checked first: a bad call is the caller's
  /// error before anything moves).
  bool mapped(const torch::Tensor& t, int peer, std::uint32_t tag, const char* what) const {
    check_tensor(t, -1, what, /*any_device=*/true);
    if (peer < 0 || peer >= size())
      throw std::invalid_argument(std::string("ipc ") + what + ": no rank " + std::to_string(peer));
    if (tag & kAckBit)
      throw std::invalid_argument(std::string("ipc ") + what + ": tag " + std::to_string(tag) +
                                  " is not below 2^31 (the upper half is the transport's own)");
    return c_->same[peer] && t.nbytes() > std::size_t(c_->opts.inline_max_bytes);
  }

  std::shared_ptr<core> c_;
};

// --- host memory: POSIX shared memory -----------------------------------------------------

std::string errno_text() { return std::strerror(errno); }

void check_host(const torch::Tensor& t, const char* what) {
  if (!t.device().is_cpu())
    throw std::invalid_argument(std::string("host ipc memory: ") + what + " is on " + t.device().str() +
                                ", not in host memory");
}

class host_export final : public ipc_export {
 public:
  explicit host_export(std::size_t bytes) : capacity_(bytes) {
    static std::atomic<unsigned> counter{0};
    std::random_device rd;
    handle_ = "/troupe-ipc-" + std::to_string(::getpid()) + "-" + std::to_string(counter++) + "-" +
              std::to_string(rd());
    const int fd = ::shm_open(handle_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) throw transport_error("shm_open " + handle_ + ": " + errno_text());
    if (::ftruncate(fd, off_t(bytes)) != 0) {
      const auto e = errno_text();
      ::close(fd);
      ::shm_unlink(handle_.c_str());
      throw transport_error("ftruncate " + handle_ + " to " + std::to_string(bytes) + " bytes: " + e);
    }
    ptr_ = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ::close(fd);
    if (ptr_ == MAP_FAILED) {
      ::shm_unlink(handle_.c_str());
      throw transport_error("mmap " + handle_ + ": " + errno_text());
    }
  }
  ~host_export() override {
    ::munmap(ptr_, capacity_);
    ::shm_unlink(handle_.c_str());  // if the peer never mapped it (ENOENT otherwise)
  }
  std::size_t capacity() const override { return capacity_; }
  const std::string& handle() const override { return handle_; }
  void copy_in(const torch::Tensor& src, const ipc_fence*) override {
    check_host(src, "a sent tensor");
    std::memcpy(ptr_, src.data_ptr(), src.nbytes());
  }

 private:
  std::size_t capacity_;
  std::string handle_;
  void* ptr_ = nullptr;
};

class host_import final : public ipc_import {
 public:
  explicit host_import(const std::string& name) {
    const int fd = ::shm_open(name.c_str(), O_RDWR, 0600);
    if (fd < 0) throw transport_error("shm_open " + name + ": " + errno_text());
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      const auto e = errno_text();
      ::close(fd);
      throw transport_error("fstat " + name + ": " + e);
    }
    size_ = std::size_t(st.st_size);
    ptr_ = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd, 0);
    ::close(fd);
    if (ptr_ == MAP_FAILED) throw transport_error("mmap " + name + ": " + errno_text());
    ::shm_unlink(name.c_str());  // mapped: the name is no longer needed, nothing is left behind
  }
  ~host_import() override { ::munmap(ptr_, size_); }
  void start_copy_out(torch::Tensor dst, const ipc_fence*) override {
    check_host(dst, "a receive tensor");
    if (dst.nbytes() > size_)
      throw transport_error("a " + std::to_string(size_) + "-byte buffer cannot fill " +
                            std::to_string(dst.nbytes()) + " bytes");
    std::memcpy(dst.data_ptr(), ptr_, dst.nbytes());
  }
  bool copy_done() override { return true; }
  void wait_copy() override {}

 private:
  std::size_t size_ = 0;
  void* ptr_ = nullptr;
};

class host_memory final : public ipc_memory {
 public:
  std::string name() const override { return "shared host memory"; }
  std::shared_ptr<ipc_fence> fence(const torch::Tensor&) override { return nullptr; }
  std::unique_ptr<ipc_export> allocate(std::size_t bytes) override { return std::make_unique<host_export>(bytes); }
  std::unique_ptr<ipc_import> open(const std::string& handle) override {
    return std::make_unique<host_import>(handle);
  }
};

std::string first_line(const std::string& path) {
  std::ifstream f(path);
  std::string s;
  std::getline(f, s);
  return s;
}

}  // namespace

std::shared_ptr<ipc_memory> host_ipc_memory() { return std::make_shared<host_memory>(); }

std::shared_ptr<communicator> ipc_p2p(std::shared_ptr<communicator> inner, std::shared_ptr<ipc_memory> memory,
                                      std::vector<bool> same_machine, ipc_options opts) {
  return std::make_shared<ipc_communicator>(std::move(inner), std::move(memory), std::move(same_machine), opts);
}

std::string machine_key() {
  std::string boot = first_line("/proc/sys/kernel/random/boot_id");
  if (boot.empty()) {
    char host[256] = {0};
    ::gethostname(host, sizeof host - 1);
    boot = host;
  }
  char ns[128] = {0};
  const auto n = ::readlink("/proc/self/ns/ipc", ns, sizeof ns - 1);
  return boot + "/" + (n > 0 ? std::string(ns, std::size_t(n)) : std::string("?"));
}

}  // namespace troupe::transport
