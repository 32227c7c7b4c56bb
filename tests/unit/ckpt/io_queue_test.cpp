// The checkpointer's I/O threads: every operation runs, never more at once than there are
// threads, and a failure is raised once, by wait(), drain() or the next submit().
#include "ckpt/io_queue.h"

#include <gtest/gtest.h>

#include <atomic>
#include <future>

#include "harness/harness.h"
#include "loom/error.h"

namespace loom::ckpt {
namespace {

using loom::testing::error_of;

TEST(IoQueue, RunsEveryOperationAndDrainWaitsForThem) {
  IoQueue io(2);
  std::atomic<int> done{0};
  std::vector<int> slots(100, 0);
  for (int i = 0; i < 100; ++i)
    io.submit([&, i] {
      slots[i] = i + 1;
      ++done;
    });
  io.drain();
  EXPECT_EQ(done.load(), 100);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(slots[i], i + 1);
}

TEST(IoQueue, NeverRunsMoreOperationsAtOnceThanItHasThreads) {
  IoQueue io(3);
  std::atomic<int> running{0}, most{0};
  for (int i = 0; i < 300; ++i) {
    io.submit([&] {
      const int now = ++running;
      for (int seen = most.load(); now > seen && !most.compare_exchange_weak(seen, now);) {
      }
      volatile double x = 0;  // a little work, so that operations overlap
      for (int k = 0; k < 20000; ++k) x = x + k;
      --running;
    });
  }
  io.drain();
  EXPECT_LE(most.load(), 3);
  EXPECT_GE(most.load(), 1);
}

TEST(IoQueue, WaitRaisesItsOperationsFailureOnce) {
  IoQueue io(2);
  // bad fails only once good is queued: a failure already finished would be raised by the
  // second submit() instead (SubmitAfterAFailureRaisesItAndQueuesNothing).
  std::promise<void> good_queued;
  std::shared_future<void> queued = good_queued.get_future().share();
  const auto bad = io.submit([queued] {
    queued.wait();
    throw IoError("writing f at offset 0: disk on fire");
  });
  const auto good = io.submit([] {});
  good_queued.set_value();
  EXPECT_EQ(error_of<IoError>([&] { io.wait(bad); }), "writing f at offset 0: disk on fire");
  io.wait(good);
  io.drain();  // raised already: nothing left
}

TEST(IoQueue, DrainRaisesTheFirstFailureAndTheQueueWorksOnAfterwards) {
  IoQueue io(1);
  io.submit([] { throw IoError("first"); });
  EXPECT_EQ(error_of<IoError>([&] { io.drain(); }), "first");
  std::atomic<bool> ran{false};
  io.submit([&] { ran = true; });
  io.drain();
  EXPECT_TRUE(ran.load());
}

TEST(IoQueue, SubmitAfterAFailureRaisesItAndQueuesNothing) {
  IoQueue io(1);
  io.submit([] { throw IoError("no space left"); });
  std::atomic<bool> ran{false};
  // With one thread, this submit waits for the first operation to finish, then sees it failed.
  EXPECT_EQ(error_of<IoError>([&] { io.submit([&] { ran = true; }); }), "no space left");
  io.drain();
  EXPECT_FALSE(ran.load());
}

TEST(IoQueue, NeedsAThread) {
  EXPECT_EQ(error_of<InvalidArgument>([] { IoQueue io(0); }),
            "IoQueue: threads must be positive, got 0");
}

}  // namespace
}  // namespace loom::ckpt
