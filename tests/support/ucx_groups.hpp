#pragma once
// Groups of UCX communicators between the threads of this process (shared memory): what
// node processes would use between processes, for tests of the tensor- and
// expert-parallel layers.
#include <memory>
#include <string>
#include <vector>

#include "actors/tp_groups.hpp"
#include "transport/ucx/ucx_communicator.hpp"

namespace troupe::test {

inline std::vector<std::shared_ptr<collective_group>> ucx_groups(int size) {
  std::vector<std::unique_ptr<transport::ucx_pending>> pending;
  std::vector<std::string> addresses;
  for (int r = 0; r < size; ++r) {
    pending.push_back(transport::prepare_ucx_communicator(r, size));
    addresses.push_back(pending.back()->address());
  }
  std::vector<std::shared_ptr<collective_group>> out;
  for (auto& p : pending) out.push_back(as_collective_group(p->connect(addresses)));
  return out;
}

}  // namespace troupe::test
