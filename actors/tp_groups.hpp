#pragma once
// Tensor-parallel groups over transport/ communicators: compute/'s collective_group (the
// blocking collectives the parallel layers call) as the transport's asynchronous ones.
#include <memory>

#include "compute/collective_group.hpp"
#include "transport/transport.hpp"

namespace troupe {

/// `comm` as a collective_group: each collective is started and waited for.
std::shared_ptr<collective_group> as_collective_group(std::shared_ptr<transport::communicator> comm);

/// Groups whose ranks are threads of this process (transport/local/: bit-identical sums
/// to the UCX backend's).
std::vector<std::shared_ptr<collective_group>> in_process_groups(int size);

}  // namespace troupe
