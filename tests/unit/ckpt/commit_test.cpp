// The commit protocol over an InMemoryStore, without a network or files: the keys and values
// it writes, the tally, a rank that never reports, values it did not write, calls out of
// order, and the whole protocol with ranks as threads.
#include "ckpt/commit.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "harness/harness.h"
#include "loom/comm/store.h"
#include "loom/error.h"

namespace loom::ckpt {

bool operator==(const RankReport& a, const RankReport& b) {
  return a.rank == b.rank && a.status == b.status && a.detail == b.detail;
}
bool operator==(const Verdict& a, const Verdict& b) {
  return a.decision == b.decision && a.detail == b.detail;
}
void PrintTo(const RankReport& r, std::ostream* out) {
  *out << "{rank " << r.rank << ", " << status_name(r.status) << ", \"" << r.detail << "\"}";
}
void PrintTo(const Verdict& v, std::ostream* out) {
  *out << "{" << decision_name(v.decision) << ", \"" << v.detail << "\"}";
}

namespace {

using loom::testing::error_of;
using loom::testing::expect_all_ok;
using loom::testing::run_threads;
using Clock = StepCommit::Clock;

const auto kLater = Clock::now() + std::chrono::minutes(5);  // a deadline never reached

TEST(Commit, KeysAndValuesAreATokenLineAndTheDetailUnderThePrefix) {
  comm::InMemoryStore store;
  StepCommit rank0(store, "run/ckpt", 5, 0, 2), rank1(store, "run/ckpt", 5, 1, 2);
  rank1.report(RankStatus::kWritten, "{\"step\":5}");
  EXPECT_EQ(store.get("run/ckpt/5/rank_1", std::chrono::milliseconds(0)), "written\n{\"step\":5}");
  EXPECT_EQ(rank0.await_reports(kLater),
            (std::vector<RankReport>{{1, RankStatus::kWritten, "{\"step\":5}"}}));
  rank0.decide(Decision::kCommitted);
  EXPECT_EQ(store.get("run/ckpt/5/commit", std::chrono::milliseconds(0)), "committed\n");
  EXPECT_EQ(rank1.await_decision(kLater), (Verdict{Decision::kCommitted, ""}));
  EXPECT_EQ(rank0.key("finished"), "run/ckpt/5/finished");
}

TEST(Commit, TheLastRankToFinishRemovesTheKeys) {
  comm::InMemoryStore store;
  StepCommit rank0(store, "ckpt", 1, 0, 3), rank1(store, "ckpt", 1, 1, 3),
      rank2(store, "ckpt", 1, 2, 3);
  rank1.report(RankStatus::kWritten, "a");
  rank2.report(RankStatus::kWritten, "b");
  rank0.await_reports(kLater);
  rank0.decide(Decision::kCommitted);
  rank0.finish();
  rank1.await_decision(kLater);
  rank1.finish();
  const std::vector<std::string> keys = {"ckpt/1/rank_1", "ckpt/1/rank_2", "ckpt/1/commit",
                                         "ckpt/1/finished"};
  for (const auto& k : keys) EXPECT_TRUE(store.check({k})) << k;
  rank2.await_decision(kLater);
  rank2.finish();
  for (const auto& k : keys) EXPECT_FALSE(store.check({k})) << k;
  EXPECT_EQ(rank2.phase(), StepCommit::Phase::kFinished);
}

TEST(Commit, TallyLetsAFailureWinOverASkipAndASkipOverSuccess) {
  EXPECT_EQ(tally({}), (Verdict{Decision::kCommitted, ""}));
  EXPECT_EQ(tally({{1, RankStatus::kWritten, "{}"}, {2, RankStatus::kWritten, "{}"}}),
            (Verdict{Decision::kCommitted, ""}));
  EXPECT_EQ(tally({{1, RankStatus::kWritten, "{}"},
                   {2, RankStatus::kSkipped, "busy"},
                   {3, RankStatus::kSkipped, "also busy"}}),
            (Verdict{Decision::kSkipped, "rank 2: busy"}));
  EXPECT_EQ(tally({{1, RankStatus::kSkipped, "busy"},
                   {2, RankStatus::kFailed, "rank 2 could not write: disk full"},
                   {3, RankStatus::kFailed, "rank 3 could not write: EIO"}}),
            (Verdict{Decision::kFailed, "rank 2 could not write: disk full"}));
}

TEST(Commit, ARankThatNeverReportsFailsTheStepOnEveryRank) {
  comm::InMemoryStore store;
  StepCommit rank0(store, "ckpt", 3, 0, 3), rank1(store, "ckpt", 3, 1, 3);
  rank1.report(RankStatus::kWritten, "{}");
  // Rank 2 never reports; the deadline has passed.
  const std::string timeout = error_of<Timeout>([&] { rank0.await_reports(Clock::now()); });
  EXPECT_EQ(timeout,
            "checkpoint commit of step 3: timed out after 0 ms waiting for rank 2's report (key "
            "'ckpt/3/rank_2')");
  EXPECT_EQ(rank0.phase(), StepCommit::Phase::kDecided);
  EXPECT_EQ(rank1.await_decision(kLater), (Verdict{Decision::kFailed, "rank 0: " + timeout}));
}

TEST(Commit, ADecisionThatNeverComesIsATimeoutNamingTheKey) {
  comm::InMemoryStore store;
  StepCommit rank1(store, "ckpt", 4, 1, 2);
  rank1.report(RankStatus::kWritten, "{}");
  EXPECT_EQ(error_of<Timeout>([&] { rank1.await_decision(Clock::now()); }),
            "checkpoint commit of step 4: timed out after 0 ms waiting for rank 0's decision (key "
            "'ckpt/4/commit')");
}

TEST(Commit, AnAbandonedWaitEndsBeforeItsDeadlineAndFailsTheStep) {
  comm::InMemoryStore store;
  std::atomic<bool> abandon{false};
  StepCommit rank0(store, "ckpt", 5, 0, 2), rank1(store, "ckpt", 5, 1, 2);
  rank0.abandon_when(abandon);
  std::thread owner([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    abandon = true;  // rank 1 is dead: its report never comes
  });
  const auto start = Clock::now();
  const std::string abandoned = error_of<Error>([&] { rank0.await_reports(kLater); });
  EXPECT_EQ(abandoned,
            "checkpoint commit of step 5: abandoned while waiting for rank 1's report (key "
            "'ckpt/5/rank_1'): the Checkpointer's owner is unwinding from a failure");
  owner.join();
  EXPECT_LT(Clock::now() - start, std::chrono::minutes(1));  // not the deadline, 5 minutes on
  EXPECT_EQ(rank0.phase(), StepCommit::Phase::kDecided);
  rank1.report(RankStatus::kWritten, "{}");
  EXPECT_EQ(rank1.await_decision(kLater), (Verdict{Decision::kFailed, "rank 0: " + abandoned}));

  StepCommit waiting1(store, "ckpt", 6, 1, 2);
  waiting1.abandon_when(abandon);
  waiting1.report(RankStatus::kWritten, "{}");
  EXPECT_EQ(error_of<Error>([&] { waiting1.await_decision(kLater); }),
            "checkpoint commit of step 6: abandoned while waiting for rank 0's decision (key "
            "'ckpt/6/commit'): the Checkpointer's owner is unwinding from a failure");
}

TEST(Commit, ASkipOrAFailureOfRankZeroDecidesAtOnce) {
  comm::InMemoryStore store;
  StepCommit rank0(store, "ckpt", 8, 0, 2), rank1(store, "ckpt", 8, 1, 2);
  rank0.decide(Decision::kSkipped, "the save of step 7 was still in flight on rank 0");
  rank1.report(RankStatus::kWritten, "{}");
  EXPECT_EQ(rank1.await_decision(kLater),
            (Verdict{Decision::kSkipped, "the save of step 7 was still in flight on rank 0"}));

  StepCommit failed0(store, "ckpt", 9, 0, 2), failed1(store, "ckpt", 9, 1, 2);
  failed0.decide(Decision::kFailed, "rank 0 could not write its file: EIO");
  failed1.report(RankStatus::kWritten, "{}");
  EXPECT_EQ(failed1.await_decision(kLater),
            (Verdict{Decision::kFailed, "rank 0 could not write its file: EIO"}));
}

TEST(Commit, AValueThisProtocolDidNotWriteIsCorruptDataAndFailsTheStep) {
  comm::InMemoryStore store;
  store.set("ckpt/6/rank_1", "ok\n{}");  // the form of an older protocol
  StepCommit rank0(store, "ckpt", 6, 0, 2);
  const std::string message = error_of<CorruptData>([&] { rank0.await_reports(kLater); });
  EXPECT_EQ(message,
            "checkpoint commit key ckpt/6/rank_1 holds \"ok\", which is not a status this "
            "protocol writes (is another program using the same Store prefix?)");
  EXPECT_EQ(store.get("ckpt/6/commit", std::chrono::milliseconds(0)), "failed\nrank 0: " + message);
}

TEST(Commit, CallsOutOfOrderAreRefused) {
  comm::InMemoryStore store;
  StepCommit rank0(store, "ckpt", 2, 0, 2), rank1(store, "ckpt", 2, 1, 2);
  EXPECT_EQ(error_of<InvalidArgument>([&] { rank0.report(RankStatus::kWritten, "{}"); }),
            "checkpoint commit of step 2: report() is not allowed on rank 0 in phase open");
  EXPECT_EQ(error_of<InvalidArgument>([&] { rank1.await_decision(kLater); }),
            "checkpoint commit of step 2: await_decision() is not allowed on rank 1 in phase open");
  EXPECT_EQ(error_of<InvalidArgument>([&] { rank1.decide(Decision::kCommitted); }),
            "checkpoint commit of step 2: decide() is not allowed on rank 1 in phase open");
  rank0.decide(Decision::kSkipped, "busy");
  EXPECT_EQ(error_of<InvalidArgument>([&] { rank0.await_reports(kLater); }),
            "checkpoint commit of step 2: await_reports() is not allowed on rank 0 in phase "
            "decided");
  rank0.finish();
  EXPECT_EQ(error_of<InvalidArgument>([&] { rank0.finish(); }),
            "checkpoint commit of step 2: finish() is not allowed on rank 0 in phase finished");
  EXPECT_EQ(error_of<InvalidArgument>([&] { StepCommit(store, "ckpt", 2, 2, 2); }),
            "checkpoint commit: rank 2 is not in [0, world_size = 2)");
}

// The protocol as the checkpointer drives it, ranks as threads: every rank learns the verdict.
TEST(Commit, RanksAsThreadsAgreeOnTheVerdict) {
  for (const RankStatus rank2 : {RankStatus::kWritten, RankStatus::kSkipped, RankStatus::kFailed}) {
    SCOPED_TRACE(status_name(rank2));
    const Verdict expected = rank2 == RankStatus::kWritten ? Verdict{Decision::kCommitted, ""}
                             : rank2 == RankStatus::kSkipped
                                 ? Verdict{Decision::kSkipped, "rank 2: why"}
                                 : Verdict{Decision::kFailed, "why"};
    expect_all_ok(run_threads(4, [&](loom::testing::Rank& r) {
      StepCommit commit(r.store, "ckpt", 10, r.rank, r.world);
      if (r.rank == 0) {
        const Verdict verdict = tally(commit.await_reports(kLater));
        EXPECT_EQ(verdict, expected);
        commit.decide(verdict.decision, verdict.detail);
      } else if (r.rank == 2 && rank2 != RankStatus::kWritten) {
        commit.report(rank2, "why");  // a rank that failed or skipped does not wait
      } else {
        commit.report(RankStatus::kWritten, "{}");
        EXPECT_EQ(commit.await_decision(kLater), expected);
      }
      commit.finish();
    }));
  }
}

}  // namespace
}  // namespace loom::ckpt
