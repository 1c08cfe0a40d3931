#pragma once
// An ipc_memory (transport/ipc) that counts the buffers it exported and mapped: tests
// check that buffers are used, and reused.
#include <atomic>
#include <memory>
#include <string>

#include "transport/ipc/ipc.hpp"

namespace troupe::test {

class counting_memory final : public transport::ipc_memory {
 public:
  explicit counting_memory(std::shared_ptr<transport::ipc_memory> m) : m_(std::move(m)) {}
  std::string name() const override { return m_->name(); }
  std::shared_ptr<transport::ipc_fence> fence(const torch::Tensor& t) override { return m_->fence(t); }
  std::unique_ptr<transport::ipc_export> allocate(std::size_t bytes) override {
    ++allocated;
    return m_->allocate(bytes);
  }
  std::unique_ptr<transport::ipc_import> open(const std::string& handle) override {
    ++opened;
    return m_->open(handle);
  }
  std::atomic<int> allocated{0}, opened{0};

 private:
  std::shared_ptr<transport::ipc_memory> m_;
};

}  // namespace troupe::test
