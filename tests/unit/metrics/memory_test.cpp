// process_memory reads this process's resident set from /proc.
#include "loom/metrics/memory.h"

#include <gtest/gtest.h>

#include <vector>

namespace loom::metrics {
namespace {

TEST(Memory, RssGrowsWhenMemoryIsTouched) {
  const MemoryUsage before = process_memory();
  EXPECT_GT(before.rss_bytes, 0);
  EXPECT_GE(before.peak_rss_bytes, before.rss_bytes);
  std::vector<char> block(64 << 20, 1);  // 64 MiB, written so it is resident
  const MemoryUsage after = process_memory();
  EXPECT_GT(after.rss_bytes, before.rss_bytes + (32 << 20));
  EXPECT_GE(after.peak_rss_bytes, after.rss_bytes);
  EXPECT_EQ(block[12345], 1);
}

}  // namespace
}  // namespace loom::metrics
