// SplitMix64 (Steele, Lea and Flood, 2014): Loom's one integer mixer, behind the sample order
// (data/permutation), per-rank seeds, Gloo collective tags and mixture draws. Private to Loom.
// Changing it changes every sample order and seed: see data/permutation.h before touching it.
#pragma once

#include <cstdint>

namespace loom::util {

inline constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;  // 2^64 / golden ratio

// SplitMix64's finalizer: a bijective 64-bit mix with full avalanche.
constexpr uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Output number i (from 0) of the SplitMix64 stream that starts at `seed`.
constexpr uint64_t splitmix64(uint64_t seed, uint64_t i) { return mix64(seed + kGolden * (i + 1)); }

// A double uniform in [0, 1) from the top 53 bits of x.
constexpr double unit_interval(uint64_t x) { return static_cast<double>(x >> 11) * 0x1p-53; }

}  // namespace loom::util
