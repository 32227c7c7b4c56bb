// WorkImpl, the Work handle of every backend: completed by the backend's thread (Gloo) or polled
// (NCCL: a CUDA event and the communicator's error). Both modes share the timeout path.

#include "comm/work.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "harness/harness.h"
#include "loom/error.h"

namespace loom::comm {
namespace {

using std::chrono::milliseconds;

TEST(WorkImpl, CompletedByTheBackendWakesEveryWaiter) {
  WorkImpl work("all_reduce", 3, "'world' (rank 0 of 2)", milliseconds(5000), nullptr);
  EXPECT_FALSE(work.is_completed());
  std::vector<std::thread> waiters;
  std::atomic<int> woke{0};
  for (int i = 0; i < 4; ++i) {
    waiters.emplace_back([&] {
      work.wait();
      ++woke;
    });
  }
  work.complete(nullptr);
  for (auto& t : waiters) t.join();
  EXPECT_EQ(woke, 4);
  EXPECT_TRUE(work.is_completed());
  EXPECT_EQ(work.exception(), nullptr);
  work.complete(std::make_exception_ptr(CommError("late")));  // ignored: completes once
  EXPECT_EQ(work.exception(), nullptr);
}

TEST(WorkImpl, TimeoutNamesOpSequenceGroupAndTheHooksNote) {
  int hooked = 0;
  WorkImpl work("broadcast", 7, "'world' (rank 1 of 2)", milliseconds(5000),
                [&](const WorkImpl& w) {
                  ++hooked;
                  return "note for #" + std::to_string(w.sequence());
                });
  const std::string message =
      loom::testing::error_of<Timeout>([&] { work.wait(milliseconds(20)); });
  for (const char* word : {"broadcast #7", "'world' (rank 1 of 2)", "20 ms", "note for #7"}) {
    EXPECT_NE(message.find(word), std::string::npos) << word << " not in " << message;
  }
  EXPECT_EQ(hooked, 1);
}

TEST(WorkImpl, PolledWorkSettlesOnceWithThePollsOutcome) {
  std::atomic<int> polls{0};
  std::atomic<bool> finished{false};
  std::atomic<bool> concurrent{false};
  std::atomic<int> inside{0};
  WorkImpl work("all_reduce", 1, "g", milliseconds(5000), nullptr,
                [&]() -> std::optional<std::exception_ptr> {
                  if (++inside > 1) concurrent = true;
                  ++polls;
                  std::optional<std::exception_ptr> outcome;
                  if (finished) outcome = std::make_exception_ptr(CommError("nccl said no"));
                  --inside;
                  return outcome;
                });
  EXPECT_FALSE(work.is_completed());
  std::vector<std::thread> threads;
  std::atomic<int> errors{0};
  for (int i = 0; i < 4; ++i) {
    threads.emplace_back([&] {
      try {
        work.wait();
      } catch (const CommError& e) {
        if (std::string(e.what()) == "nccl said no") ++errors;
      }
    });
  }
  std::this_thread::sleep_for(milliseconds(20));
  finished = true;
  for (auto& t : threads) t.join();
  EXPECT_EQ(errors, 4);
  EXPECT_FALSE(concurrent) << "the poll ran on two threads at once";
  const int after = polls;
  EXPECT_TRUE(work.is_completed());
  EXPECT_NE(work.exception(), nullptr);
  EXPECT_EQ(polls, after) << "polled again after it settled";
}

TEST(WorkImpl, PolledWorkTimesOutThroughTheSameHook) {
  bool hooked = false;
  WorkImpl work(
      "send", 2, "g", milliseconds(5000),
      [&](const WorkImpl&) {
        hooked = true;
        return std::string("communicator aborted");
      },
      []() -> std::optional<std::exception_ptr> { return std::nullopt; });
  const std::string message =
      loom::testing::error_of<Timeout>([&] { work.wait(milliseconds(10)); });
  EXPECT_TRUE(hooked);
  EXPECT_NE(message.find("send #2"), std::string::npos) << message;
  EXPECT_NE(message.find("communicator aborted"), std::string::npos) << message;
  EXPECT_FALSE(work.is_completed());
}

TEST(WorkImpl, PolledSuccessIsNoError) {
  WorkImpl work("barrier", 1, "g", milliseconds(5000), nullptr,
                []() -> std::optional<std::exception_ptr> { return std::exception_ptr(); });
  work.wait();
  EXPECT_TRUE(work.is_completed());
  EXPECT_EQ(work.exception(), nullptr);
}

}  // namespace
}  // namespace loom::comm
