#pragma once
#include <cstddef>
#include <cstdint>

namespace troupe {

/// The standard 64-bit splitmix mixer (WORKLOADS.md "Determinism"), modulo 2^64.
constexpr std::uint64_t splitmix64(std::uint64_t x) {
  std::uint64_t z = x + 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

/// The key every deterministic draw of a run starts from: seed * 2^32 + index.
constexpr std::uint64_t seeded_key(std::uint64_t seed, std::uint64_t index) {
  return (seed << 32) + index;
}

/// FNV-1a, 64 bits: the fingerprints of data files, tokenizers and token caches. Chains:
/// pass the previous result as `hash` to go on over more bytes.
constexpr std::uint64_t fnv1a_basis = 0xcbf29ce484222325ULL;
inline std::uint64_t fnv1a(const char* p, std::size_t n, std::uint64_t hash = fnv1a_basis) {
  for (std::size_t i = 0; i < n; ++i) hash = (hash ^ std::uint8_t(p[i])) * 0x100000001b3ULL;
  return hash;
}

}  // namespace troupe
