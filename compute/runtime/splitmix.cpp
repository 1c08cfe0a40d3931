#include "compute/runtime/splitmix.hpp"

namespace troupe {
static_assert(splitmix64(0) == 16294208416658607535ULL, "splitmix64 check value");
}  // namespace troupe
