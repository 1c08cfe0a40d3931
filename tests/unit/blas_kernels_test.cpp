// launch/blas_kernels.hpp: OpenBLAS computes with the kernels the CPU's features allow,
// also on a CPU whose model it does not know (where it would fall back to Prescott's).
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include <strings.h>

#include "launch/blas_kernels.hpp"
#include "build_paths.hpp"

namespace {

/// `troupe blas-core` run by the shell with `env` before it: its first output line.
std::string troupe_blas_core(const std::string& env) {
  const std::string cmd = "env " + env + " " + troupe::test::troupe_binary + " blas-core";
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return "(popen failed)";
  char line[256] = {};
  const bool got = std::fgets(line, sizeof line, p) != nullptr;
  const int status = pclose(p);
  std::string out = got ? line : "";
  if (!out.empty() && out.back() == '\n') out.pop_back();
  return status == 0 ? out : "(exit " + std::to_string(status) + ")";
}

}  // namespace

TEST(BlasKernels, AProcessComputesWithKernelsTheCpuAllowsAndKeepsAChosenOne) {
  if (troupe::blas_core_in_use().empty()) GTEST_SKIP() << "the BLAS loaded is not OpenBLAS";
  // Left to choose (no OPENBLAS_CORETYPE): never OpenBLAS's generic fallback on a CPU with
  // AVX2 or AVX-512 (Debian 12's OpenBLAS falls back on CPUs it does not know, such as
  // Emerald Rapids, model 207).
  const auto chosen = troupe_blas_core("-u OPENBLAS_CORETYPE");
  ASSERT_FALSE(chosen.empty());
  ASSERT_NE(chosen.front(), '(') << chosen;
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    EXPECT_NE(strcasecmp(chosen.c_str(), "Prescott"), 0) << "OpenBLAS's slowest kernels on a CPU with AVX2";
  // What the variable names stands, even kernels slower than the CPU allows.
  EXPECT_EQ(troupe_blas_core("OPENBLAS_CORETYPE=Prescott"), "Prescott");
  // Set (as tests/run does): nothing left to ask for.
  const char* before = std::getenv("OPENBLAS_CORETYPE");
  const std::string kept = before ? before : "";
  ::setenv("OPENBLAS_CORETYPE", chosen.c_str(), 1);
  EXPECT_EQ(troupe::blas_core_to_ask_for(), "");
  before ? ::setenv("OPENBLAS_CORETYPE", kept.c_str(), 1) : ::unsetenv("OPENBLAS_CORETYPE");
}
