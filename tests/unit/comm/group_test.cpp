// The backend-independent parts of comm::Group: shard_range and ReduceOp names.

#include "loom/comm/group.h"

#include <gtest/gtest.h>

#include <vector>

#include "loom/error.h"

namespace loom::comm {
namespace {

std::vector<int64_t> shard_sizes(int64_t n, int size) {
  std::vector<int64_t> sizes;
  for (int rank = 0; rank < size; ++rank) sizes.push_back(shard_range(n, size, rank).size());
  return sizes;
}

TEST(ShardRange, ChunksOfCeilingSizeWithTheRemainderLast) {
  EXPECT_EQ(shard_sizes(10, 4), (std::vector<int64_t>{3, 3, 3, 1}));
  EXPECT_EQ(shard_sizes(7, 3), (std::vector<int64_t>{3, 3, 1}));
  EXPECT_EQ(shard_sizes(12, 4), (std::vector<int64_t>{3, 3, 3, 3}));
  EXPECT_EQ(shard_sizes(1000003, 2), (std::vector<int64_t>{500002, 500001}));
  EXPECT_EQ(shard_range(10, 4, 3).begin, 9);
  EXPECT_EQ(shard_range(10, 4, 3).end, 10);
}

TEST(ShardRange, LastRanksMayGetNothing) {
  EXPECT_EQ(shard_sizes(1, 4), (std::vector<int64_t>{1, 0, 0, 0}));
  EXPECT_EQ(shard_sizes(5, 4), (std::vector<int64_t>{2, 2, 1, 0}));
  EXPECT_EQ(shard_sizes(0, 3), (std::vector<int64_t>{0, 0, 0}));
  // An empty shard is the empty range at the end, never past it.
  EXPECT_EQ(shard_range(1, 4, 3).begin, 1);
  EXPECT_EQ(shard_range(1, 4, 3).end, 1);
}

TEST(ShardRange, ShardsTileTheRangeInRankOrder) {
  for (int64_t n = 0; n <= 40; ++n) {
    for (int size = 1; size <= 9; ++size) {
      int64_t next = 0;
      for (int rank = 0; rank < size; ++rank) {
        const ShardRange shard = shard_range(n, size, rank);
        ASSERT_EQ(shard.begin, next) << "n=" << n << " size=" << size << " rank=" << rank;
        ASSERT_LE(shard.begin, shard.end);
        ASSERT_LE(shard.size(), (n + size - 1) / size);
        next = shard.end;
      }
      ASSERT_EQ(next, n) << "n=" << n << " size=" << size;
    }
  }
}

TEST(ShardRange, RejectsBadArguments) {
  EXPECT_THROW(shard_range(-1, 2, 0), InvalidArgument);
  EXPECT_THROW(shard_range(4, 0, 0), InvalidArgument);
  EXPECT_THROW(shard_range(4, 2, 2), InvalidArgument);
  EXPECT_THROW(shard_range(4, 2, -1), InvalidArgument);
}

TEST(ReduceOpNames, AreLowerCaseWords) {
  EXPECT_STREQ(to_string(ReduceOp::kSum), "sum");
  EXPECT_STREQ(to_string(ReduceOp::kAvg), "avg");
  EXPECT_STREQ(to_string(ReduceOp::kMin), "min");
  EXPECT_STREQ(to_string(ReduceOp::kMax), "max");
}

}  // namespace
}  // namespace loom::comm
