#include "compute/runtime/host_memory.hpp"

#include <cstdlib>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace troupe {

bool tune_host_allocator() {
#if defined(__GLIBC__)
  for (const char* user : {"GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"})
    if (std::getenv(user)) return false;
  return mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1 && mallopt(M_TRIM_THRESHOLD, 1 << 30) == 1;
#else
  return false;
#endif
}

}  // namespace troupe
