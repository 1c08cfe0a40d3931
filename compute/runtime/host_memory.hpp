#pragma once
// The host allocator for training (no CAF, no LibTorch).

namespace troupe {

/// Tunes glibc's malloc, which LibTorch's CPU tensors come from, for a training loop that
/// frees and allocates the same large activations every micro-batch: blocks up to 32 MiB
/// (glibc's highest threshold on 64-bit) come from the heap instead of a fresh mmap each
/// time, and freed memory stays in the process (the heap is trimmed only above 1 GiB of
/// free space at its top). Otherwise the kernel maps and zeroes those pages again and
/// again (a zero-bubble gpt-tiny step took 30-45 % longer; docs/performance.md). The
/// process keeps its peak heap (a few per cent more resident memory). Leaves the
/// allocator alone where the user set GLIBC_TUNABLES or MALLOC_MMAP_THRESHOLD_ /
/// MALLOC_TRIM_THRESHOLD_, and off glibc. Returns true when it changed the settings.
bool tune_host_allocator();

}  // namespace troupe
