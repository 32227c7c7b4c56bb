// The process side of the multi-rank test harness. Each child re-runs the same TEST and ends
// inside run_processes, so the checks after the call run in the parent only.

#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <set>
#include <stdexcept>
#include <thread>

#include "harness/harness.h"

namespace loom::testing {
namespace {

using std::chrono::milliseconds;

TEST(RunProcesses, RanksAreSeparateProcessesSharingAFileStore) {
  static constexpr int kWorld = 3;
  expect_all_ok(run_processes(kWorld, [](Rank& r) {
    EXPECT_TRUE(in_child_process());
    EXPECT_EQ(r.world, kWorld);
    r.store.set("pid/" + std::to_string(r.rank), std::to_string(::getpid()));
    // Distinct pids: every rank is its own process.
    std::set<std::string> pids;
    for (int peer = 0; peer < r.world; ++peer) {
      pids.insert(r.store.get("pid/" + std::to_string(peer), milliseconds(20000)));
    }
    EXPECT_EQ(pids.size(), static_cast<size_t>(kWorld));
    EXPECT_TRUE(std::filesystem::is_directory(r.dir));
  }));
  EXPECT_FALSE(in_child_process());
}

TEST(RunProcesses, ExtraEnvironmentReachesEveryChild) {
  ProcessOptions options;
  options.env["LOOM_HARNESS_TEST_COLOR"] = "teal";
  expect_all_ok(run_processes(
      2,
      [](Rank&) {
        const char* color = std::getenv("LOOM_HARNESS_TEST_COLOR");
        ASSERT_NE(color, nullptr);
        EXPECT_STREQ(color, "teal");
      },
      options));
}

TEST(RunProcesses, AThrowingRankFailsWithItsMessageWhileOthersPass) {
  const auto outcomes = run_processes(3, [](Rank& r) {
    if (r.rank == 1) throw std::runtime_error("rank one gave up");
  });
  ASSERT_EQ(outcomes.size(), 3u);
  EXPECT_TRUE(outcomes[0].ok) << outcomes[0].error;
  EXPECT_TRUE(outcomes[2].ok) << outcomes[2].error;
  EXPECT_FALSE(outcomes[1].ok);
  EXPECT_EQ(outcomes[1].rank, 1);
  EXPECT_NE(outcomes[1].error.find("exited with code 1"), std::string::npos) << outcomes[1].error;
  EXPECT_NE(outcomes[1].error.find("rank one gave up"), std::string::npos) << outcomes[1].error;
}

TEST(RunProcesses, AGoogleTestFailureInAChildFailsThatRank) {
  const auto outcomes =
      run_processes(2, [](Rank& r) { EXPECT_EQ(r.rank, 0) << "only rank zero agrees"; });
  EXPECT_TRUE(outcomes[0].ok) << outcomes[0].error;
  EXPECT_FALSE(outcomes[1].ok);
  EXPECT_NE(outcomes[1].error.find("only rank zero agrees"), std::string::npos)
      << outcomes[1].error;
}

TEST(RunProcesses, AKilledRankIsReportedWithItsSignal) {
  const auto outcomes = run_processes(2, [](Rank& r) {
    if (r.rank == 0) ::raise(SIGKILL);
  });
  EXPECT_FALSE(outcomes[0].ok);
  EXPECT_NE(outcomes[0].error.find("killed by signal 9"), std::string::npos) << outcomes[0].error;
  EXPECT_TRUE(outcomes[1].ok) << outcomes[1].error;
}

TEST(RunProcesses, AHangingRankIsKilledAtTheTimeout) {
  ProcessOptions options;
  options.timeout = std::chrono::seconds(3);
  const auto start = std::chrono::steady_clock::now();
  const auto outcomes = run_processes(
      2,
      [](Rank& r) {
        if (r.rank == 1) std::this_thread::sleep_for(std::chrono::minutes(10));
      },
      options);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
  // Rank 0 is not checked: on a loaded machine even its start-up may outlast the timeout.
  EXPECT_FALSE(outcomes[1].ok);
  EXPECT_NE(outcomes[1].error.find("did not finish within 3s"), std::string::npos)
      << outcomes[1].error;
}

}  // namespace
}  // namespace loom::testing
