#include "transport/ordered_p2p.hpp"

#include <map>
#include <mutex>
#include <utility>

#include <torch/torch.h>

#include "transport/caller_stream.hpp"

namespace troupe::transport {

namespace {

class ordered_comm final : public communicator, public std::enable_shared_from_this<ordered_comm> {
 public:
  ordered_comm(std::shared_ptr<communicator> inner, std::vector<std::shared_ptr<ordered_link>> to,
               std::vector<std::shared_ptr<ordered_link>> from, ordered_options opts)
      : inner_(std::move(inner)), to_(std::move(to)), from_(std::move(from)), opts_(opts) {
    const auto n = static_cast<std::size_t>(inner_->size());
    if (to_.empty()) to_.resize(n);
    if (from_.empty()) from_.resize(n);
    if (to_.size() != n || from_.size() != n)
      throw std::invalid_argument("ordered_p2p: links for " + std::to_string(n) + " ranks expected");
    for (std::size_t r = 0; r < n; ++r) {
      out_.push_back(std::make_unique<outgoing>());
      in_.push_back(std::make_unique<incoming>());
    }
  }

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string backend() const override {
    std::string links;
    for (std::size_t r = 0; r < to_.size(); ++r)
      if (to_[r] || from_[r]) {
        links += (links.empty() ? "" : ", ") + std::to_string(r);
        const auto& l = to_[r] ? to_[r] : from_[r];
        links += " (" + l->backend() + ")";
      }
    return inner_->backend() + "; in-order links to rank(s) " + links;
  }

  work_ptr send(torch::Tensor t, int dst, std::uint32_t tag) override {
    if (!linked(to_, dst, t)) return inner_->send(std::move(t), dst, tag);
    check_tensor(t, -1, "send", /*any_device=*/true);
    auto control = torch::empty({2}, torch::kInt64);
    auto& out = *out_[dst];
    work_ptr data;
    {
      std::lock_guard<std::mutex> lk(out.mu);  // the link carries the sends in seq order
      control.data_ptr<std::int64_t>()[0] = out.next++;
      control.data_ptr<std::int64_t>()[1] = static_cast<std::int64_t>(t.nbytes());
      data = to_[dst]->send(std::move(t));
    }
    return all_of({data, inner_->send(control, dst, tag)}, "ordered send");
  }

  work_ptr recv(torch::Tensor t, int src, std::uint32_t tag) override {
    if (!linked(from_, src, t)) return inner_->recv(std::move(t), src, tag);
    check_tensor(t, -1, "recv", /*any_device=*/true);
    auto fence = from_[src]->fence(t);  // on the caller's thread
    auto control = torch::empty({2}, torch::kInt64);
    auto outer = std::make_shared<work>("ordered recv");
    std::weak_ptr<ordered_comm> me = weak_from_this();
    inner_->recv(control, src, tag)->on_complete([me, control, src, e = entry{t, fence, outer, 0}](
                                                     const std::string& err) mutable {
      auto self = me.lock();
      if (!self) return outer_fail(e.outer, "communicator closed");
      if (!err.empty()) {  // its seq is lost: the link cannot stay in step
        self->break_link(src, "a control message failed: " + err);
        return outer_fail(e.outer, err);
      }
      e.bytes = control.data_ptr<std::int64_t>()[1];
      self->arrived(src, control.data_ptr<std::int64_t>()[0], std::move(e));
    });
    return outer;
  }

  work_ptr all_reduce(torch::Tensor t) override { return inner_->all_reduce(std::move(t)); }
  work_ptr reduce_scatter(torch::Tensor input, torch::Tensor output) override {
    return inner_->reduce_scatter(std::move(input), std::move(output));
  }
  work_ptr all_gather(torch::Tensor input, torch::Tensor output) override {
    return inner_->all_gather(std::move(input), std::move(output));
  }
  work_ptr broadcast(torch::Tensor t, int root) override { return inner_->broadcast(std::move(t), root); }

  void abort(const std::string& why) override {
    inner_->abort(why);
    for (std::size_t r = 0; r < from_.size(); ++r) {
      if (to_[r]) to_[r]->abort(why);
      if (from_[r]) break_link(static_cast<int>(r), why);
    }
  }

 private:
  struct entry {
    torch::Tensor t;
    std::shared_ptr<link_fence> fence;
    work_ptr outer;
    std::int64_t bytes;  // sent
  };
  struct outgoing {
    std::mutex mu;
    std::int64_t next = 0;
  };
  struct incoming {
    std::mutex mu;
    std::int64_t next = 0;                // the seq whose link receive is posted next
    std::map<std::int64_t, entry> known;  // receives whose control message came, by seq
    std::string broken;
  };

  static void outer_fail(const work_ptr& w, const std::string& why) { w->complete(why.empty() ? "failed" : why); }

  bool linked(const std::vector<std::shared_ptr<ordered_link>>& links, int peer, const torch::Tensor& t) const {
    return peer >= 0 && peer < static_cast<int>(links.size()) && links[peer] &&
           static_cast<std::int64_t>(t.nbytes()) > opts_.inline_max_bytes;
  }

  /// The control message of `seq` from `src` came: posts every link receive that is now
  /// next in order.
  void arrived(int src, std::int64_t seq, entry e) {
    auto& in = *in_[src];
    std::vector<std::pair<work_ptr, std::string>> fail;
    {
      std::lock_guard<std::mutex> lk(in.mu);
      if (!in.broken.empty()) {
        fail.emplace_back(e.outer, in.broken);
      } else if (seq < in.next || in.known.count(seq) || e.bytes < 0) {
        fail.emplace_back(e.outer, "ordered recv from rank " + std::to_string(src) + ": control message for seq " +
                                       std::to_string(seq) + " (" + std::to_string(e.bytes) + " bytes) out of place");
      } else {
        in.known.emplace(seq, std::move(e));
        for (auto it = in.known.begin(); it != in.known.end() && it->first == in.next; it = in.known.erase(it)) {
          ++in.next;
          post(*from_[src], src, std::move(it->second));
        }
      }
    }
    for (auto& [w, why] : fail) outer_fail(w, why);
  }

  /// Posts the link receive of one entry (in seq order: the caller holds the peer's lock).
  /// A receive that was aborted, or whose size differs from the sent one, takes the bytes
  /// into a scratch tensor: the link stays in step.
  static void post(ordered_link& link, int src, entry e) {
    const bool fits = static_cast<std::int64_t>(e.t.nbytes()) == e.bytes;
    if (e.outer->done() || !fits) {
      auto scratch = fits ? torch::empty(e.t.sizes(), e.t.options().device(torch::kCPU))
                          : torch::empty({e.bytes}, torch::kUInt8);
      link.recv(scratch, link.fence(scratch))->on_complete([scratch](const std::string&) {});
      if (!fits)
        outer_fail(e.outer, "ordered recv from rank " + std::to_string(src) + ": " + std::to_string(e.bytes) +
                                " bytes were sent, the receive takes " + std::to_string(e.t.nbytes()));
      return;
    }
    link.recv(e.t, std::move(e.fence))->on_complete([outer = e.outer](const std::string& err) { outer->complete(err); });
  }

  /// Fails the receives from `src` that wait for their turn, and every later one.
  void break_link(int src, const std::string& why) {
    std::map<std::int64_t, entry> failed;
    {
      std::lock_guard<std::mutex> lk(in_[src]->mu);
      if (in_[src]->broken.empty()) in_[src]->broken = why;
      failed.swap(in_[src]->known);
    }
    from_[src]->abort(why);
    for (auto& [seq, e] : failed) outer_fail(e.outer, why);
  }

  std::shared_ptr<communicator> inner_;
  std::vector<std::shared_ptr<ordered_link>> to_, from_;
  const ordered_options opts_;
  std::vector<std::unique_ptr<outgoing>> out_;
  std::vector<std::unique_ptr<incoming>> in_;
};

class tag_link_impl final : public ordered_link {
 public:
  tag_link_impl(std::shared_ptr<communicator> c, int peer, std::uint32_t tag) : c_(std::move(c)), peer_(peer), tag_(tag) {}
  std::string backend() const override { return c_->backend() + ", one tag"; }
  work_ptr send(torch::Tensor t) override { return c_->send(std::move(t), peer_, tag_); }
  /// GPU tensors: the caller's stream, which the receive is posted under (a staged
  /// communicator copies into `t` on it) though it is posted later on another thread.
  struct stream_fence final : link_fence {
    explicit stream_fence(c10::Stream s) : stream(s) {}
    c10::Stream stream;
  };
  std::shared_ptr<link_fence> fence(const torch::Tensor& t) override {
    const auto s = caller_stream_of(t);
    return s ? std::make_shared<stream_fence>(*s) : nullptr;
  }
  work_ptr recv(torch::Tensor t, std::shared_ptr<link_fence> fence) override {
    c10::optional<c10::Stream> stream;
    if (const auto* f = dynamic_cast<const stream_fence*>(fence.get())) stream = f->stream;
    c10::OptionalStreamGuard on(stream);
    return c_->recv(std::move(t), peer_, tag_);
  }
  void abort(const std::string& why) override { c_->abort(why); }

 private:
  std::shared_ptr<communicator> c_;
  const int peer_;
  const std::uint32_t tag_;
};

}  // namespace

std::shared_ptr<communicator> ordered_p2p(std::shared_ptr<communicator> inner,
                                          std::vector<std::shared_ptr<ordered_link>> to,
                                          std::vector<std::shared_ptr<ordered_link>> from, ordered_options opts) {
  return std::make_shared<ordered_comm>(std::move(inner), std::move(to), std::move(from), opts);
}

std::shared_ptr<ordered_link> tag_link(std::shared_ptr<communicator> c, int peer, std::uint32_t tag) {
  return std::make_shared<tag_link_impl>(std::move(c), peer, tag);
}

}  // namespace troupe::transport
