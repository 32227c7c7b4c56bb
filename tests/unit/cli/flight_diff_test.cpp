// `loom flight diff`'s comparison (tools/loom/flight_diff.h) on hand-made recorders for each
// way ranks can diverge.
#include "flight_diff.h"

#include <gtest/gtest.h>

#include <fstream>

#include "harness/harness.h"
#include "loom/comm/flight_recorder.h"
#include "loom/error.h"
#include "unit/comm/flight_ops.h"

namespace loom::cli {
namespace {

using comm::flight_dump_file;
using comm::FlightRecorder;
using comm::OpState;
using testing::add_op;
using testing::all_reduces;
using testing::contains;

void dump_all(const testing::TempDir& dir, const std::vector<const FlightRecorder*>& ranks) {
  for (size_t r = 0; r < ranks.size(); ++r) {
    ranks[r]->dump(flight_dump_file(dir.path(), static_cast<int>(r)), static_cast<int>(r), "world");
  }
}

void write(const std::filesystem::path& path, const std::string& text) {
  std::ofstream(path) << text;
}

TEST(FlightDiff, AgreeingRanksNameTheLastCollective) {
  testing::TempDir dir;
  FlightRecorder a, b;
  all_reduces(a, 3);
  add_op(a, "broadcast", "float32", 16, {0}, OpState::kCompleted);
  all_reduces(b, 3);
  add_op(b, "broadcast", "float32", 16, {0}, OpState::kCompleted);
  dump_all(dir, {&a, &b});
  FlightDiff diff = diff_flight_dumps(dir.path());
  EXPECT_FALSE(diff.diverged) << diff.description;
  EXPECT_EQ(diff.sequence, 4u);
  EXPECT_EQ(diff.ranks, (std::vector<int>{0, 1}));
  EXPECT_EQ(diff.group, "world");
  EXPECT_EQ(diff.description,
            "all 2 ranks agree up to collective #4; the last, #4 (broadcast float32[16] root 0), "
            "completed on every rank");
}

TEST(FlightDiff, ReadingErrorsPassThrough) {
  testing::TempDir dir;
  EXPECT_THROW(diff_flight_dumps(dir / "nope"), IoError);
  write(dir / "rank_0.json", "{");
  EXPECT_THROW(diff_flight_dumps(dir.path()), CorruptData);
}

TEST(FlightDiff, RankListsCollapseRuns) {
  EXPECT_EQ(rank_list({}), "");
  EXPECT_EQ(rank_list({3}), "3");
  EXPECT_EQ(rank_list({0, 1}), "0, 1");
  EXPECT_EQ(rank_list({0, 2, 3, 4, 5, 7}), "0, 2-5, 7");
}

TEST(FlightDiff, DifferentOpsAtOneSequence) {
  testing::TempDir dir;
  FlightRecorder r0, r1;
  all_reduces(r0, 6);
  all_reduces(r1, 6);
  add_op(r0, "all_reduce", "float32", 1024, {}, OpState::kStarted);
  add_op(r1, "broadcast", "float32", 16, {0}, OpState::kStarted);
  dump_all(dir, {&r0, &r1});
  FlightDiff diff = diff_flight_dumps(dir.path());
  EXPECT_TRUE(diff.diverged);
  EXPECT_EQ(diff.sequence, 7u);
  EXPECT_EQ(diff.description,
            "ranks issued different collectives as #7: rank 0: all_reduce float32[1024]; "
            "rank 1: broadcast float32[16] root 0");
}

TEST(FlightDiff, DifferentSizesGroupRanks) {
  testing::TempDir dir;
  FlightRecorder r[4];
  for (int i = 0; i < 4; ++i) {
    all_reduces(r[i], 2);
    add_op(r[i], "all_reduce", i == 1 ? "bfloat16" : "float32", 1024, {}, OpState::kStarted);
  }
  dump_all(dir, {&r[0], &r[1], &r[2], &r[3]});
  FlightDiff diff = diff_flight_dumps(dir.path());
  EXPECT_TRUE(diff.diverged);
  EXPECT_EQ(diff.sequence, 3u);
  EXPECT_EQ(diff.description,
            "ranks issued different collectives as #3: ranks 0, 2, 3: all_reduce float32[1024]; "
            "rank 1: all_reduce bfloat16[1024]");
}

TEST(FlightDiff, RankThatNeverIssuedTheNextCollective) {
  testing::TempDir dir;
  FlightRecorder r0, r1, r2;
  all_reduces(r0, 7, OpState::kStarted);
  all_reduces(r1, 6);
  all_reduces(r2, 7, OpState::kEnqueued);
  dump_all(dir, {&r0, &r1, &r2});
  FlightDiff diff = diff_flight_dumps(dir.path());
  EXPECT_TRUE(diff.diverged);
  EXPECT_EQ(diff.sequence, 7u);
  EXPECT_EQ(diff.description,
            "rank 1 never issued collective #7 (all_reduce float32[1024]); its last op was #6 "
            "(all_reduce float32[1024], completed); ranks 0, 2 issued it (rank 0: started; "
            "rank 2: enqueued)");
}

TEST(FlightDiff, RanksThatIssuedNothing) {
  testing::TempDir dir;
  FlightRecorder r0, r1, r2;
  add_op(r0, "barrier", "", 0, {}, OpState::kStarted);
  dump_all(dir, {&r0, &r1, &r2});
  FlightDiff diff = diff_flight_dumps(dir.path());
  EXPECT_TRUE(diff.diverged);
  EXPECT_EQ(diff.sequence, 1u);
  EXPECT_EQ(diff.description,
            "ranks 1, 2 never issued collective #1 (barrier); they issued no collective at all; "
            "rank 0 issued it (started)");
}

TEST(FlightDiff, RanksStuckInACollectiveOthersCompleted) {
  testing::TempDir dir;
  FlightRecorder r0, r1, r2;
  all_reduces(r0, 7);
  all_reduces(r1, 7, OpState::kStarted);
  all_reduces(r2, 7, OpState::kFailed);
  for (FlightRecorder* r : {&r0, &r1, &r2}) add_op(*r, "barrier", "", 0, {}, OpState::kEnqueued);
  dump_all(dir, {&r0, &r1, &r2});
  FlightDiff diff = diff_flight_dumps(dir.path());
  EXPECT_TRUE(diff.diverged);
  EXPECT_EQ(diff.sequence, 7u);
  EXPECT_EQ(diff.description,
            "ranks disagree on the outcome of collective #7 (all_reduce float32[1024]): rank 1 is "
            "stuck in it (started); rank 2 failed it; rank 0 completed it");
}

TEST(FlightDiff, AllRanksInFlightInTheSameCollectiveAgree) {
  testing::TempDir dir;
  FlightRecorder r0, r1;
  all_reduces(r0, 5, OpState::kStarted);
  all_reduces(r1, 5, OpState::kStarted);
  add_op(r0, "barrier", "", 0, {}, OpState::kEnqueued);
  add_op(r1, "barrier", "", 0, {}, OpState::kEnqueued);
  dump_all(dir, {&r0, &r1});
  FlightDiff diff = diff_flight_dumps(dir.path());
  EXPECT_FALSE(diff.diverged);
  EXPECT_EQ(diff.sequence, 6u);
  EXPECT_EQ(diff.description,
            "all 2 ranks agree up to collective #6; #5 (all_reduce float32[1024]) is in flight on "
            "every rank (started), so the ranks are not out of step: suspect a dead or slow peer "
            "or the network");
}

TEST(FlightDiff, TruncatedBuffersCompareTheOverlap) {
  testing::TempDir dir;
  FlightRecorder small(4), large(100);
  // Before the overlap the ops differ, but rank 0 no longer holds them: not a divergence.
  all_reduces(small, 6);
  for (int i = 0; i < 6; ++i) add_op(large, "broadcast", "float32", 8, {0}, OpState::kCompleted);
  all_reduces(small, 4);
  all_reduces(large, 4);
  dump_all(dir, {&small, &large});
  FlightDiff diff = diff_flight_dumps(dir.path());
  EXPECT_FALSE(diff.diverged) << diff.description;
  EXPECT_EQ(diff.sequence, 10u);
  EXPECT_EQ(diff.description,
            "all 2 ranks agree up to collective #10 (compared #7..#10; older entries were "
            "dropped from the ring buffers); the last, #10 (all_reduce float32[1024]), completed "
            "on every rank");

  // A divergence inside the overlap is found.
  add_op(small, "all_reduce", "float32", 1024, {}, OpState::kStarted);
  add_op(large, "all_gather", "float32", 1024, {}, OpState::kStarted);
  dump_all(dir, {&small, &large});
  diff = diff_flight_dumps(dir.path());
  EXPECT_TRUE(diff.diverged);
  EXPECT_EQ(diff.sequence, 11u);
}

TEST(FlightDiff, StuckRankBeforeTheOthersBuffersBegin) {
  testing::TempDir dir;
  FlightRecorder ahead(3), behind;
  all_reduces(ahead, 10, OpState::kStarted);
  all_reduces(behind, 2);
  dump_all(dir, {&ahead, &behind});
  FlightDiff diff = diff_flight_dumps(dir.path());
  EXPECT_TRUE(diff.diverged);
  EXPECT_EQ(diff.sequence, 3u);
  EXPECT_EQ(diff.description,
            "rank 1 never issued collective #3 (no longer in the other ranks' ring buffers); its "
            "last op was #2 (all_reduce float32[1024], completed); rank 0 issued it");
}

TEST(FlightDiff, MatchingSendAndRecvAgree) {
  testing::TempDir dir;
  FlightRecorder r0, r1;
  add_op(r0, "send", "float32", 16, {1}, OpState::kCompleted);
  add_op(r1, "recv", "float32", 16, {0}, OpState::kCompleted);
  dump_all(dir, {&r0, &r1});
  EXPECT_FALSE(diff_flight_dumps(dir.path()).diverged);

  add_op(r0, "send", "float32", 16, {1}, OpState::kStarted);
  add_op(r1, "recv", "float32", 8, {0}, OpState::kStarted);
  dump_all(dir, {&r0, &r1});
  FlightDiff diff = diff_flight_dumps(dir.path());
  EXPECT_TRUE(diff.diverged);
  EXPECT_EQ(diff.description,
            "ranks issued different collectives as #2: rank 0: send float32[16] to 1; rank 1: "
            "recv float32[8] from 0");
}

TEST(FlightDiff, NamesRanksWithoutADump) {
  testing::TempDir dir;
  FlightRecorder r0, r2;
  all_reduces(r0, 2);
  all_reduces(r2, 2);
  r0.dump(flight_dump_file(dir.path(), 0), 0, "world");
  r2.dump(flight_dump_file(dir.path(), 2), 2, "world");
  write(dir / "rank_1.json.tmp", "partial");  // other names are ignored
  write(dir / "notes.txt", "x");
  FlightDiff diff = diff_flight_dumps(dir.path());
  EXPECT_FALSE(diff.diverged);
  EXPECT_EQ(diff.ranks, (std::vector<int>{0, 2}));
  EXPECT_TRUE(contains(diff.description, "; no dump from rank 1, which was not compared"))
      << diff.description;
}

}  // namespace
}  // namespace loom::cli
