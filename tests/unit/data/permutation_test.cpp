// Permutation: a bijection of [0, n) for every n, inverse-consistent, keyed by (seed, epoch),
// identical across processes and builds, and spread evenly.

#include "data/permutation.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "loom/error.h"

namespace loom::data {
namespace {

// Checks every position of a small-enough order: each value in range, hit exactly once, and
// index_of undoes at.
void expect_bijection(uint64_t n, uint64_t seed, uint64_t epoch) {
  const Permutation order(n, seed, epoch);
  std::vector<bool> seen(n, false);
  for (uint64_t i = 0; i < n; ++i) {
    const uint64_t v = order.at(i);
    ASSERT_LT(v, n) << "n=" << n << " i=" << i;
    ASSERT_FALSE(seen[v]) << "n=" << n << ": value " << v << " appears twice";
    seen[v] = true;
    ASSERT_EQ(order.index_of(v), i) << "n=" << n;
  }
}

TEST(PermutationTest, IsABijectionForManySizes) {
  for (uint64_t n : {1ull, 2ull, 3ull, 4ull, 5ull, 7ull, 15ull, 16ull, 17ull, 1000ull, 1ull << 16,
                     (1ull << 16) + 1}) {
    expect_bijection(n, 1234, 0);
    expect_bijection(n, 99, 5);
  }
}

TEST(PermutationTest, IsABijectionForAMillion) { expect_bijection(1000000, 7, 3); }

// Sizes too large to enumerate: spot-check that at and index_of are inverses and stay in range.
TEST(PermutationTest, AtAndIndexOfAreInversesForHugeSizes) {
  for (uint64_t n : {(1ull << 40) + 3, 1ull << 62, (1ull << 63) - 1, 1ull << 63, ~0ull}) {
    const Permutation order(n, 42, 1);
    for (uint64_t k = 0; k < 200; ++k) {
      const uint64_t i = k * (n / 200) + k;  // spread over the range, including 0
      const uint64_t v = order.at(i);
      ASSERT_LT(v, n);
      EXPECT_EQ(order.index_of(v), i) << "n=" << n;
      EXPECT_EQ(order.at(order.index_of(i)), i) << "n=" << n;
    }
    EXPECT_EQ(order.index_of(order.at(n - 1)), n - 1);
  }
}

TEST(PermutationTest, OutOfRangeAndEmptyAreInvalidArgument) {
  EXPECT_THROW(Permutation(0, 1, 0), InvalidArgument);
  const Permutation order(10, 1, 0);
  EXPECT_THROW(order.at(10), InvalidArgument);
  EXPECT_THROW(order.index_of(10), InvalidArgument);
}

// Every Loom build on every machine must produce these: a checkpoint stores only a position
// in the order. If this fails, the order changed: bump Permutation::kAlgorithm (old states
// must be refused, not reinterpreted) and then update the expected values.
TEST(PermutationTest, OrderIsFixedAcrossProcessesAndBuilds) {
  EXPECT_STREQ(Permutation::kAlgorithm, "feistel8-splitmix64-v1");
  struct Case {
    uint64_t n;
    std::vector<uint64_t> first;
  };
  const std::vector<Case> cases = {
      {10, {2, 3, 7, 5, 0}},
      {1000, {44, 42, 2, 968, 442}},
      {1ull << 40,
       {13678100145ull, 321179756759ull, 879827429957ull, 83521466878ull, 287864909232ull}},
      {1ull << 63,
       {6779981252026550196ull, 98420836705432535ull, 6230057362062284537ull,
        8381775468885484218ull, 5213834285109070677ull}},
  };
  for (const Case& c : cases) {
    const Permutation order(c.n, 42, 7);
    for (uint64_t i = 0; i < c.first.size(); ++i) {
      EXPECT_EQ(order.at(i), c.first[i]) << "n=" << c.n << " i=" << i;
    }
  }
}

std::vector<uint64_t> prefix(const Permutation& order, uint64_t count) {
  std::vector<uint64_t> out;
  for (uint64_t i = 0; i < count; ++i) out.push_back(order.at(i));
  return out;
}

TEST(PermutationTest, SameKeyGivesSameOrderAndOtherKeysDiffer) {
  const uint64_t n = 1000;
  EXPECT_EQ(prefix(Permutation(n, 5, 2), 32), prefix(Permutation(n, 5, 2), 32));
  const std::vector<uint64_t> base = prefix(Permutation(n, 5, 2), 32);
  EXPECT_NE(prefix(Permutation(n, 5, 3), 32), base);  // next epoch
  EXPECT_NE(prefix(Permutation(n, 6, 2), 32), base);  // next seed
  EXPECT_NE(prefix(Permutation(n, 6, 1), 32), base);  // seed + 1, epoch - 1
  EXPECT_NE(prefix(Permutation(n, 4, 3), 32), base);  // seed - 1, epoch + 1
  // Consecutive epochs of one seed all differ from each other.
  std::vector<std::vector<uint64_t>> epochs;
  for (uint64_t e = 0; e < 20; ++e) epochs.push_back(prefix(Permutation(n, 5, e), 16));
  for (size_t a = 0; a < epochs.size(); ++a) {
    for (size_t b = a + 1; b < epochs.size(); ++b) EXPECT_NE(epochs[a], epochs[b]);
  }
}

// Pearson's chi-square statistic of counts against a uniform expectation.
double chi_square(const std::vector<int>& counts, double expected) {
  double chi = 0;
  for (int c : counts) chi += (c - expected) * (c - expected) / expected;
  return chi;
}

// Over many keys, where element 0 lands (and what lands at position 0) spreads evenly. The
// bounds are generous (p < 1e-6 for a uniform source) so the test never flakes; a broken
// round function or cycle walk gives statistics in the hundreds or thousands.
TEST(PermutationTest, PositionsAreSpreadUniformlyOverKeys) {
  struct Case {
    uint64_t n;
    int bins;
    double bound;  // ~ p = 1e-6 for bins - 1 degrees of freedom
  };
  for (const Case c : {Case{5, 5, 35.0}, Case{1000, 10, 50.0}, Case{(1ull << 20) + 7, 16, 60.0}}) {
    const int keys = 20000;
    std::vector<int> where_zero(c.bins, 0), what_first(c.bins, 0);
    for (int k = 0; k < keys; ++k) {
      const Permutation order(c.n, static_cast<uint64_t>(k), 0);
      where_zero[order.index_of(0) * c.bins / c.n]++;
      what_first[order.at(0) * c.bins / c.n]++;
    }
    const double expected = static_cast<double>(keys) / c.bins;
    EXPECT_LT(chi_square(where_zero, expected), c.bound) << "n=" << c.n;
    EXPECT_LT(chi_square(what_first, expected), c.bound) << "n=" << c.n;
  }
}

// Neighbours in the order are unrelated: the joint distribution of (at(0), at(1)) over keys,
// in 4 x 4 cells, is uniform (with the diagonal cells' deficit of exactly-equal pairs
// negligible at this n).
TEST(PermutationTest, NeighbouringPositionsAreIndependent) {
  const uint64_t n = 1 << 12;
  const int keys = 16000;
  std::vector<int> cells(16, 0);
  for (int k = 0; k < keys; ++k) {
    const Permutation order(n, 77, static_cast<uint64_t>(k));
    cells[order.at(0) * 4 / n * 4 + order.at(1) * 4 / n]++;
  }
  EXPECT_LT(chi_square(cells, keys / 16.0), 60.0);
}

}  // namespace
}  // namespace loom::data
