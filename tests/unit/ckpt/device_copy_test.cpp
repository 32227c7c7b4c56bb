// The checkpointer's host staging memory (src/ckpt/device_copy.h): page-aligned, rounded up to
// whole pages (O_DIRECT writes pad the last block inside it), movable, and usable whether or not
// it could be pinned (pinning needs CUDA and a GPU; without them it is ordinary memory).
#include "ckpt/device_copy.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <utility>

namespace loom::ckpt::internal {
namespace {

TEST(HostBuffer, IsPageAlignedAndRoundedToWholePages) {
  for (bool pinned : {false, true}) {
    HostBuffer buffer(5000, pinned);
    ASSERT_NE(buffer.data(), nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(buffer.data()) % 4096, 0u);
    EXPECT_EQ(buffer.size(), 8192u);
    std::memset(buffer.data(), 0xab, buffer.size());  // all of it is ours
    EXPECT_EQ(static_cast<unsigned char>(buffer.data()[8191]), 0xab);
    if (!pinned) {
      EXPECT_FALSE(buffer.pinned());
    }
  }
}

TEST(HostBuffer, MovesOwnership) {
  HostBuffer a(4096, false);
  char* data = a.data();
  HostBuffer b = std::move(a);
  EXPECT_EQ(b.data(), data);
  EXPECT_EQ(a.data(), nullptr);  // NOLINT(bugprone-use-after-move): the moved-from state
  EXPECT_EQ(a.size(), 0u);
  HostBuffer c(1, false);
  c = std::move(b);
  EXPECT_EQ(c.data(), data);
  EXPECT_EQ(c.size(), 4096u);
  HostBuffer empty;
  EXPECT_EQ(empty.data(), nullptr);
  EXPECT_EQ(empty.size(), 0u);
}

}  // namespace
}  // namespace loom::ckpt::internal
