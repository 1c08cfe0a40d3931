#pragma once
// OpenBLAS's kernels for this CPU: a process-level choice made from the environment
// (launch/, where environment variables are read).
#include <string>

namespace troupe {

/// The OpenBLAS core type (OPENBLAS_CORETYPE) this process should ask for, or "" where
/// there is nothing to ask: OpenBLAS is not the BLAS loaded, the user chose a core type,
/// or OpenBLAS chose kernels of its own. OpenBLAS picks its kernels by the CPU's model
/// number when the library loads; Debian 12's 0.3.21 does not know newer CPUs (Emerald
/// Rapids, model 207, which some VMs report as a generic "Intel Xeon Processor") and
/// falls back to its generic x86-64 kernels (Prescott, SSE3): single-precision matrix
/// products 4.6 times slower on such a machine (a 512 sgemm on one core: 32.5 against 148
/// GFLOP/s; docs/performance.md). Then this names the
/// best of OpenBLAS's kernel sets that the CPU's features allow: Cooperlake (AVX-512 with
/// bf16), SkylakeX (AVX-512), Haswell (AVX2 and FMA), Sandybridge (AVX).
std::string blas_core_to_ask_for();

/// The core type of the OpenBLAS kernels loaded ("Cooperlake", "Prescott", ...), or "" where
/// the BLAS is not OpenBLAS.
std::string blas_core_in_use();

/// If blas_core_to_ask_for() names a core type: sets OPENBLAS_CORETYPE to it and runs this
/// program again (`argv` as given; OpenBLAS reads the variable only when it loads), so
/// that this process and every process it starts compute with those kernels. Returns
/// where nothing is to be done, or where the program cannot be run again. Call it first
/// in main. Scripts that export OPENBLAS_CORETYPE themselves (tests/run, tests/bench/run:
/// `troupe blas-core`) spare their processes the second start.
void run_with_blas_kernels(char** argv);

}  // namespace troupe
