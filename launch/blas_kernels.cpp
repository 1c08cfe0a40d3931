#include "launch/blas_kernels.hpp"

#include <dlfcn.h>
#include <unistd.h>

#include <cstdlib>
#include <strings.h>

namespace troupe {

std::string blas_core_in_use() {
  using corename_fn = char* (*)();
  const auto corename = reinterpret_cast<corename_fn>(dlsym(RTLD_DEFAULT, "openblas_get_corename"));
  const char* name = corename ? corename() : nullptr;
  return name ? name : "";
}

std::string blas_core_to_ask_for() {
  if (std::getenv("OPENBLAS_CORETYPE") || strcasecmp(blas_core_in_use().c_str(), "Prescott") != 0) return "";
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
                      __builtin_cpu_supports("avx512cd");
  if (avx512 && __builtin_cpu_supports("avx512bf16")) return "Cooperlake";
  if (avx512) return "SkylakeX";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "Haswell";
  if (__builtin_cpu_supports("avx")) return "Sandybridge";
#endif
  return "";
}

void run_with_blas_kernels(char** argv) {
  const auto core = blas_core_to_ask_for();
  if (core.empty() || setenv("OPENBLAS_CORETYPE", core.c_str(), 1) != 0) return;
  execv("/proc/self/exe", argv);
  unsetenv("OPENBLAS_CORETYPE");  // not run again: go on with the kernels loaded
}

}  // namespace troupe
