#include "actors/tp_groups.hpp"

#include <chrono>

#include "transport/local/local_group.hpp"

namespace troupe {

namespace {

class communicator_group final : public collective_group {
 public:
  explicit communicator_group(std::shared_ptr<transport::communicator> comm) : comm_(std::move(comm)) {}
  int rank() const override { return comm_->rank(); }
  int size() const override { return comm_->size(); }
  // (The transports take flat tensors: views of the same memory.)
  void all_reduce(torch::Tensor t) override { wait(comm_->all_reduce(t.view({-1}))); }
  void all_gather(const torch::Tensor& in, torch::Tensor out) override {
    wait(comm_->all_gather(in.view({-1}), out.view({-1})));
  }
  void reduce_scatter(const torch::Tensor& in, torch::Tensor out) override {
    wait(comm_->reduce_scatter(in.view({-1}), out.view({-1})));
  }
  void abort(const std::string& why) override { comm_->abort(why); }

 private:
  /// A collective waits for the slowest rank's compute: no deadline of its own (a rank
  /// that fails aborts the group, and the runtime's step timeout covers the rest).
  static void wait(const transport::work_ptr& w) {
    while (!w->wait(std::chrono::seconds(60))) {
    }
  }
  std::shared_ptr<transport::communicator> comm_;
};

}  // namespace

std::shared_ptr<collective_group> as_collective_group(std::shared_ptr<transport::communicator> comm) {
  return std::make_shared<communicator_group>(std::move(comm));
}

std::vector<std::shared_ptr<collective_group>> in_process_groups(int size) {
  std::vector<std::shared_ptr<collective_group>> out;
  for (auto& member : transport::make_local_group(size)) out.push_back(as_collective_group(member));
  return out;
}

}  // namespace troupe
