#pragma once
// local/: a communicator whose ranks live in one process (the optimizer shards of the
// in-process runtime). Collectives complete on the thread of the last rank to call them,
// summing in the ring's order (bit-identical to the UCX backend); send/recv copy once
// from the sender's tensor into the receiver's.
#include <memory>

#include "transport/transport.hpp"

namespace troupe::transport {

/// Makes the `size` members of one in-process group; member i is rank i. The members
/// share the group and may be used from different threads.
std::vector<std::shared_ptr<communicator>> make_local_group(int size);

}  // namespace troupe::transport
