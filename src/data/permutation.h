// A keyed pseudo-random permutation of [0, n): the global sample order of one epoch.
//
// No table is stored: at(i) and index_of(v) compute one element each in O(1) memory, so the
// order of a billion-sample dataset costs nothing to build and any position can be reached
// directly (this is what makes resume exact and instant). See docs/data-order.md.
#pragma once

#include <array>
#include <cstdint>

namespace loom::data {

// A bijection of [0, n) chosen by (seed, epoch); n may be anything in [1, 2^64 - 1].
//
// Algorithm: a balanced Feistel network over the smallest even-bit-width domain
// 2^(2k) >= n (k >= 1), with kRounds rounds whose round function is a SplitMix64-style
// mix of (round key, half); values that land at or beyond n are re-encrypted
// ("cycle-walking") until they fall inside [0, n). Since 2^(2k-2) < n, the domain is less
// than 4n (at most 4n for n <= 4), so a walk averages fewer than 4 encryptions and
// usually 1 to 2; each encryption is 8 rounds of two multiplies each.
//
// Why 8 rounds: 4 already make a strong pseudo-random permutation when the halves are wide,
// but halves of a few bits (n below a few hundred) need more; 6 rounds left the orders of
// n = 3 or 4 visibly non-uniform, 8 do not. Very small domains still cannot reach every
// order with exactly equal probability (each Feistel round is an even permutation of the
// domain); positions are uniform, which is what shuffling needs.
//
// The order is part of Loom's resume contract: a checkpoint stores only a position in it.
// Changing anything here (rounds, mixing constants, key derivation) changes every order;
// bump kAlgorithm so that old reader states are refused rather than silently reinterpreted.
//
// A Permutation is an immutable value: cheap to copy, safe to use from many threads.
class Permutation {
 public:
  // Names this algorithm in saved reader states (see SamplerState's JSON).
  static constexpr const char* kAlgorithm = "feistel8-splitmix64-v1";
  static constexpr int kRounds = 8;

  // n == 0 is InvalidArgument.
  Permutation(uint64_t n, uint64_t seed, uint64_t epoch);

  // The element at position i of the order. i >= n is InvalidArgument.
  uint64_t at(uint64_t i) const;
  // The position of value in the order: index_of(at(i)) == i. value >= n is InvalidArgument.
  uint64_t index_of(uint64_t value) const;

  uint64_t size() const { return n_; }

 private:
  uint64_t encrypt(uint64_t x) const;
  uint64_t decrypt(uint64_t x) const;
  uint64_t round_function(int round, uint64_t half) const;

  uint64_t n_;
  int half_bits_;       // k: each Feistel half holds k bits; the domain is 2^(2k)
  uint64_t half_mask_;  // 2^k - 1
  std::array<uint64_t, kRounds> round_keys_;
};

}  // namespace loom::data
