// The thread side of the multi-rank test harness: ranks see their identity and one shared
// store, and a failure (an exception or a GoogleTest failure) is pinned on the rank that had it.

#include "harness/harness.h"

#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <fstream>
#include <set>
#include <stdexcept>

#include "loom/error.h"

namespace loom::testing {
namespace {

using std::chrono::milliseconds;

TEST(TempDir, CreatesAFreshDirectoryAndRemovesItWithItsContents) {
  std::filesystem::path path;
  {
    TempDir dir("loom-tempdir-test");
    path = dir.path();
    EXPECT_TRUE(std::filesystem::is_directory(path));
    EXPECT_TRUE(std::filesystem::is_empty(path));
    std::filesystem::create_directories(dir / "a" / "b");
    std::ofstream(dir / "a" / "b" / "file") << "x";
    TempDir other("loom-tempdir-test");
    EXPECT_NE(other.path(), path);
  }
  EXPECT_FALSE(std::filesystem::exists(path));
}

TEST(RunThreads, EveryRankSeesItsIdentityAndOneSharedStoreAndDir) {
  static constexpr int kWorld = 4;
  const auto outcomes = run_threads(kWorld, [](Rank& r) {
    EXPECT_EQ(r.world, kWorld);
    r.store.set("hello/" + std::to_string(r.rank), std::to_string(r.rank * 10));
    std::ofstream(r.dir / ("rank" + std::to_string(r.rank))) << r.rank;
    // Every rank reads every other rank's value: the store is one store.
    for (int peer = 0; peer < r.world; ++peer) {
      EXPECT_EQ(r.store.get("hello/" + std::to_string(peer), milliseconds(5000)),
                std::to_string(peer * 10));
    }
    if (r.store.add("arrived", 1) == r.world) r.store.set("all-arrived", "");
    r.store.wait({"all-arrived"}, milliseconds(5000));
    EXPECT_TRUE(std::filesystem::exists(r.dir / "rank0"));
  });
  ASSERT_EQ(outcomes.size(), static_cast<size_t>(kWorld));
  std::set<int> ranks;
  for (const RankOutcome& outcome : outcomes) {
    ranks.insert(outcome.rank);
    EXPECT_TRUE(outcome.ok) << outcome.error;
  }
  EXPECT_EQ(ranks, (std::set<int>{0, 1, 2, 3}));
}

TEST(RunThreads, AThrowFailsExactlyThatRankWithTheMessage) {
  const auto outcomes = run_threads(3, [](Rank& r) {
    if (r.rank == 1) throw std::runtime_error("rank one broke");
  });
  ASSERT_EQ(outcomes.size(), 3u);
  EXPECT_TRUE(outcomes[0].ok);
  EXPECT_TRUE(outcomes[2].ok);
  EXPECT_FALSE(outcomes[1].ok);
  EXPECT_NE(outcomes[1].error.find("rank one broke"), std::string::npos) << outcomes[1].error;
  EXPECT_NE(outcomes[1].error.find("std::runtime_error"), std::string::npos) << outcomes[1].error;
}

TEST(RunThreads, AGoogleTestFailureIsAttributedToTheRankThatRecordedIt) {
  const auto outcomes =
      run_threads(4, [](Rank& r) { EXPECT_NE(r.rank, 2) << "rank two disagrees"; });
  // Nothing escaped to the enclosing test: the failure lives in rank 2's outcome only.
  EXPECT_FALSE(::testing::Test::HasFailure());
  ASSERT_EQ(outcomes.size(), 4u);
  for (const RankOutcome& outcome : outcomes) {
    EXPECT_EQ(outcome.ok, outcome.rank != 2) << outcome.rank << ": " << outcome.error;
  }
  EXPECT_NE(outcomes[2].error.find("1 GoogleTest failure(s)"), std::string::npos)
      << outcomes[2].error;
  EXPECT_NE(outcomes[2].error.find("rank two disagrees"), std::string::npos) << outcomes[2].error;
  EXPECT_NE(outcomes[2].error.find("harness_test.cpp"), std::string::npos) << outcomes[2].error;
}

TEST(RunThreads, AFatalAssertionEndsOnlyThatRanksFunction) {
  const auto outcomes = run_threads(2, [](Rank& r) {
    ASSERT_EQ(r.rank, 0) << "assert in rank " << r.rank;
    r.store.set("rank0-finished", "yes");
  });
  EXPECT_TRUE(outcomes[0].ok) << outcomes[0].error;
  EXPECT_FALSE(outcomes[1].ok);
  EXPECT_NE(outcomes[1].error.find("assert in rank 1"), std::string::npos) << outcomes[1].error;
}

TEST(RunThreads, AnExceptionAfterAFailureReportsBoth) {
  const auto outcomes = run_threads(1, [](Rank&) {
    ADD_FAILURE() << "first the expectation";
    throw loom::Timeout("then the timeout");
  });
  EXPECT_FALSE(outcomes[0].ok);
  EXPECT_NE(outcomes[0].error.find("loom::Timeout: then the timeout"), std::string::npos)
      << outcomes[0].error;
  EXPECT_NE(outcomes[0].error.find("first the expectation"), std::string::npos)
      << outcomes[0].error;
}

TEST(ExpectAllOk, RecordsOneFailurePerFailedRank) {
  const std::vector<RankOutcome> outcomes = {{0, true, ""}, {1, false, "it broke"}};
  EXPECT_NONFATAL_FAILURE(expect_all_ok(outcomes), "rank 1: it broke");
  expect_all_ok({{0, true, ""}, {1, true, ""}});  // records nothing
}

TEST(ExpectAllOk, ReportsTheFailureOfARankThread) {
  EXPECT_NONFATAL_FAILURE_ON_ALL_THREADS(
      expect_all_ok(run_threads(3, [](Rank& r) { EXPECT_LT(r.rank, 2) << "too big a rank"; })),
      "rank 2: 1 GoogleTest failure(s)");
}

TEST(RunThreads, ANonPositiveWorldIsInvalidArgument) {
  EXPECT_THROW(run_threads(0, [](Rank&) {}), InvalidArgument);
}

}  // namespace
}  // namespace loom::testing
