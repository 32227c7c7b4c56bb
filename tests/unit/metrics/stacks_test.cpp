// Every thread's stack (src/metrics/stacks.h): a named thread blocked in a wait shows up with
// its name, state and the wait in its frames; a thread that blocks the signal is listed
// without a stack, and the process survives its late answer.
#include "metrics/stacks.h"

#include <gtest/gtest.h>
#include <pthread.h>
#include <signal.h>

#include <condition_variable>
#include <mutex>
#include <thread>

#include "harness/harness.h"
#include "util/thread_name.h"

namespace loom::metrics {
namespace {

// The block of text under `thread <tid> "<name>"`, up to the next thread.
std::string block_of(const std::string& text, const std::string& name) {
  const size_t at = text.find("\"" + name + "\"");
  if (at == std::string::npos) return "";
  const size_t end = text.find("\nthread ", at);
  return text.substr(at, end == std::string::npos ? std::string::npos : end - at);
}

TEST(ThreadStacks, ShowEveryThreadWithItsNameStateAndFrames) {
  std::mutex mutex;
  std::condition_variable wake;
  bool stop = false, started = false;
  std::thread waiter([&] {
    util::name_this_thread("stack probe");
    std::unique_lock<std::mutex> lock(mutex);
    started = true;
    wake.notify_all();
    wake.wait(lock, [&] { return stop; });
  });
  {
    std::unique_lock<std::mutex> lock(mutex);
    wake.wait(lock, [&] { return started; });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // in its wait by now
  const std::string text = thread_stacks();
  {
    std::lock_guard<std::mutex> lock(mutex);
    stop = true;
  }
  wake.notify_all();
  waiter.join();

  EXPECT_TRUE(testing::contains(text, "pid " + std::to_string(::getpid()) + ", ")) << text;
  const std::string probe = block_of(text, "stack probe");
  ASSERT_FALSE(probe.empty()) << text;
  EXPECT_TRUE(testing::contains(probe, "\" state S\n")) << probe;  // sleeping in the wait
  // The wait's frames: libc exports pthread_cond_wait, so it is named.
  EXPECT_TRUE(testing::contains(probe, "pthread_cond_wait")) << probe;
  EXPECT_TRUE(testing::contains(probe, "  #0 ")) << probe;
  // The calling thread says it took the dump.
  EXPECT_TRUE(testing::contains(text, "(this thread, taking the dump)")) << text;
}

TEST(ThreadStacks, AThreadThatBlocksTheSignalIsListedWithoutAStackAndItsLateAnswerIsHarmless) {
  std::mutex mutex;
  std::condition_variable wake;
  bool stop = false, started = false;
  std::thread deaf([&] {
    util::name_this_thread("deaf probe");
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, nullptr);
    std::unique_lock<std::mutex> lock(mutex);
    started = true;
    wake.notify_all();
    wake.wait(lock, [&] { return stop; });
    lock.unlock();
    // The signal pending since the capture arrives now; the process must survive it.
    pthread_sigmask(SIG_UNBLOCK, &all, nullptr);
  });
  {
    std::unique_lock<std::mutex> lock(mutex);
    wake.wait(lock, [&] { return started; });
  }
  const std::string text = thread_stacks(std::chrono::milliseconds(50));
  EXPECT_TRUE(testing::contains(block_of(text, "deaf probe"),
                                "(no answer: the thread blocks the signal or is stopped)"))
      << text;
  {
    std::lock_guard<std::mutex> lock(mutex);
    stop = true;
  }
  wake.notify_all();
  deaf.join();
  // And a second capture still works.
  EXPECT_TRUE(testing::contains(thread_stacks(), "(this thread, taking the dump)"));
}

}  // namespace
}  // namespace loom::metrics
