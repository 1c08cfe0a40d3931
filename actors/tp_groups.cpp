#include "actors/tp_groups.hpp"

#include <chrono>
#include <cstdlib>
#include <thread>

#include "transport/local/local_group.hpp"

namespace troupe {

namespace {

/// Elements per row along dim 0 (a 1-D tensor: 1).
std::int64_t row_elements(const torch::Tensor& t) {
  std::int64_t n = 1;
  for (std::int64_t i = 1; i < t.dim(); ++i) n *= t.size(i);
  return n;
}

/// Rows of `t` (along dim 0) as elements.
std::vector<std::int64_t> elements_of(const torch::Tensor& t, std::vector<std::int64_t> rows) {
  for (auto& r : rows) r *= row_elements(t);
  return rows;
}

class communicator_group final : public collective_group {
 public:
  communicator_group(std::shared_ptr<transport::communicator> comm, std::shared_ptr<collective_traffic> traffic,
                     collective_observer observe, collective_entry enter, std::chrono::microseconds all_to_all_delay)
      : comm_(std::move(comm)),
        traffic_(std::move(traffic)),
        observe_(std::move(observe)),
        enter_(std::move(enter)),
        all_to_all_delay_(all_to_all_delay) {}
  int rank() const override { return comm_->rank(); }
  int size() const override { return comm_->size(); }
  // (The transports take flat tensors: views of the same memory.)
  void all_reduce(torch::Tensor t) override {
    run("all-reduce", &collective_traffic::all_reduce, t.numel(), t.nbytes(),
        [&] { return comm_->all_reduce(t.view({-1})); });
  }
  void all_gather(const torch::Tensor& in, torch::Tensor out) override {
    run("all-gather", &collective_traffic::all_gather, out.numel(), out.nbytes(),
        [&] { return comm_->all_gather(in.view({-1}), out.view({-1})); });
  }
  void reduce_scatter(const torch::Tensor& in, torch::Tensor out) override {
    run("reduce-scatter", &collective_traffic::reduce_scatter, in.numel(), out.nbytes(),
        [&] { return comm_->reduce_scatter(in.view({-1}), out.view({-1})); });
  }
  /// Observed (and entered on the activity board) at its wait: the time it was not
  /// hidden behind the caller's compute.
  started_collective start_all_gather(const torch::Tensor& in, torch::Tensor out, const char* name) override {
    return started(name, &collective_traffic::all_gather, out, comm_->all_gather(in.view({-1}), out.view({-1})));
  }
  started_collective start_all_to_all(const torch::Tensor& in, const std::vector<std::int64_t>& send_rows,
                                      const std::vector<std::int64_t>& recv_rows, torch::Tensor out,
                                      const char* name) override {
    return started(name, &collective_traffic::all_to_all, out,
                   comm_->all_to_all(in.view({-1}), elements_of(in, send_rows), out.view({-1}),
                                     elements_of(in, recv_rows)));
  }
  torch::Tensor all_to_all(const torch::Tensor& in, const std::vector<std::int64_t>& send_rows,
                           const std::vector<std::int64_t>& recv_rows) override {
    std::int64_t rows = 0;
    for (auto r : recv_rows) rows += r;
    auto shape = in.sizes().vec();
    shape.at(0) = rows;
    auto out = torch::empty(shape, in.options());
    run("all-to-all", &collective_traffic::all_to_all, out.numel(), out.nbytes(), [&] {
      return comm_->all_to_all(in.contiguous().view({-1}), elements_of(in, send_rows), out.view({-1}),
                               elements_of(in, recv_rows));
    });
    return out;
  }
  void abort(const std::string& why) override { comm_->abort(why); }

 private:
  /// Starts a collective and waits for it, counting it into `kind` of the traffic. It
  /// waits for the slowest rank's compute: no deadline of its own (a rank that fails
  /// aborts the group, and the runtime's step timeout covers the rest).
  template <class Start>
  void run(const char* name, std::atomic<std::int64_t> collective_traffic::*kind, std::int64_t elements,
           std::int64_t bytes, Start start) {
    if (enter_) enter_(name);
    const auto t0 = std::chrono::steady_clock::now();
    finish(name, kind, elements, bytes, start(), t0);
  }
  /// `w`, started into `out`, as the caller's started_collective: entered on the activity
  /// board and observed at its wait (the time it was not hidden behind the caller's
  /// compute); one dropped unwaited is settled with a bounded wait.
  started_collective started(const char* name, std::atomic<std::int64_t> collective_traffic::*kind,
                             const torch::Tensor& out, transport::work_ptr w) {
    return started_collective(
        [this, w, kind, elements = out.numel(), bytes = std::int64_t(out.nbytes()), name] {
          if (enter_) enter_(name);
          finish(name, kind, elements, bytes, w, std::chrono::steady_clock::now());
        },
        [w] { w->wait(std::chrono::seconds(30)); });
  }
  /// Waits for `w`, started at `t0`, and counts it.
  void finish(const char* name, std::atomic<std::int64_t> collective_traffic::*kind, std::int64_t elements,
              std::int64_t bytes, const transport::work_ptr& w, std::chrono::steady_clock::time_point t0) {
    while (!w->wait(std::chrono::seconds(60))) {
    }
    if (kind == &collective_traffic::all_to_all && all_to_all_delay_.count() > 0)
      std::this_thread::sleep_for(all_to_all_delay_);
    const auto waited = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0);
    if (observe_) observe_(name, bytes, double(waited.count()) * 1e-9);
    if (!traffic_) return;
    (traffic_.get()->*kind) += elements;
    ++traffic_->calls;
    traffic_->wait_ns += waited.count();
  }
  std::shared_ptr<transport::communicator> comm_;
  std::shared_ptr<collective_traffic> traffic_;
  collective_observer observe_;
  collective_entry enter_;
  std::chrono::microseconds all_to_all_delay_;  ///< benchmarks: launch_info::all_to_all_delay
};

}  // namespace

double collective_traffic::ring_bytes(int size) const {
  const double share = double(size - 1) / size;
  return 4.0 * share * (2.0 * double(all_reduce) + double(all_gather) + double(reduce_scatter));
}

std::shared_ptr<collective_group> as_collective_group(std::shared_ptr<transport::communicator> comm,
                                                      std::shared_ptr<collective_traffic> traffic,
                                                      collective_observer observe, collective_entry enter,
                                                      std::chrono::microseconds all_to_all_delay) {
  return std::make_shared<communicator_group>(std::move(comm), std::move(traffic), std::move(observe),
                                              std::move(enter), all_to_all_delay);
}

std::vector<std::shared_ptr<collective_group>> counted_in_process_groups(int size,
                                                                         std::shared_ptr<collective_traffic> traffic) {
  std::vector<std::shared_ptr<collective_group>> out;
  for (auto& member : transport::make_local_group(size)) out.push_back(as_collective_group(member, traffic));
  return out;
}

std::vector<std::shared_ptr<collective_group>> in_process_groups(int size) {
  return counted_in_process_groups(size, nullptr);
}

}  // namespace troupe
