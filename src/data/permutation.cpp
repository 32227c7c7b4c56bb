// The keyed Feistel permutation behind Loom's global sample order (see permutation.h).

#include "data/permutation.h"

#include "loom/error.h"
#include "util/mix.h"

namespace loom::data {
namespace {

using util::kGolden;
using util::mix64;
constexpr uint64_t kDomainTag = 0x6C6F6F6D2D646174ull;  // "loom-dat": keeps keys Loom's own

// Bits needed to hold n - 1, i.e. the smallest b with 2^b >= n (0 for n == 1).
int bit_width_of_max(uint64_t n) {
  int bits = 0;
  for (uint64_t v = n - 1; v != 0; v >>= 1) ++bits;
  return bits;
}

}  // namespace

Permutation::Permutation(uint64_t n, uint64_t seed, uint64_t epoch) : n_(n) {
  LOOM_CHECK(n >= 1, InvalidArgument, "a permutation needs at least one element, got n = 0");
  // The smallest even width 2k >= bits with k >= 1: two halves of k bits each.
  const int bits = bit_width_of_max(n);
  half_bits_ = bits <= 2 ? 1 : (bits + 1) / 2;
  half_mask_ = half_bits_ == 32 ? 0xFFFFFFFFull : (uint64_t{1} << half_bits_) - 1;

  // One stream per (seed, epoch): seed and epoch go through separate mixes so that nearby
  // pairs ((s, e) vs (s + 1, e - 1)) share nothing; round keys are its SplitMix64 outputs.
  uint64_t state = mix64(mix64(seed ^ kDomainTag) + kGolden * (epoch + 1));
  for (auto& key : round_keys_) {
    state += kGolden;
    key = mix64(state);
  }
}

uint64_t Permutation::round_function(int round, uint64_t half) const {
  return mix64(half ^ round_keys_[round]) & half_mask_;
}

// Round r maps (L, R) to (R, L ^ F_r(R)); the value is L in the high half, R in the low.
uint64_t Permutation::encrypt(uint64_t x) const {
  uint64_t left = x >> half_bits_;
  uint64_t right = x & half_mask_;
  for (int r = 0; r < kRounds; ++r) {
    const uint64_t next_right = left ^ round_function(r, right);
    left = right;
    right = next_right;
  }
  return (left << half_bits_) | right;
}

uint64_t Permutation::decrypt(uint64_t x) const {
  uint64_t left = x >> half_bits_;
  uint64_t right = x & half_mask_;
  for (int r = kRounds - 1; r >= 0; --r) {
    const uint64_t prev_left = right ^ round_function(r, left);
    right = left;
    left = prev_left;
  }
  return (left << half_bits_) | right;
}

// Cycle-walking: the Feistel network permutes the whole domain; following the cycle of i
// from inside [0, n) must come back into [0, n), and the first value found there is a
// bijection of [0, n) (the walk from each start stops at the next in-range point of its cycle).
uint64_t Permutation::at(uint64_t i) const {
  LOOM_CHECK(i < n_, InvalidArgument, "permutation position ", i, " is out of range [0, ", n_, ")");
  uint64_t v = encrypt(i);
  while (v >= n_) v = encrypt(v);
  return v;
}

uint64_t Permutation::index_of(uint64_t value) const {
  LOOM_CHECK(value < n_, InvalidArgument, "permutation value ", value, " is out of range [0, ", n_,
             ")");
  uint64_t i = decrypt(value);
  while (i >= n_) i = decrypt(i);
  return i;
}

}  // namespace loom::data
