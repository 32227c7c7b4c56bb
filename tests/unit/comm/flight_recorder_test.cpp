// The flight recorder's ring buffer and states, its JSON dump, and diff_flight_dumps on
// hand-made recorders for each way ranks can diverge.
#include "loom/comm/flight_recorder.h"

#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <set>
#include <thread>

#include "harness/harness.h"
#include "loom/error.h"

namespace loom::comm {
namespace {

// Issues one op and drives it to `state`.
void add(FlightRecorder& recorder, const std::string& op, const std::string& dtype, int64_t numel,
         std::vector<int> peers, OpState state) {
  uint64_t sequence = recorder.enqueue(op, dtype, numel, std::move(peers));
  if (state != OpState::kEnqueued) recorder.start(sequence);
  if (state == OpState::kCompleted || state == OpState::kFailed) recorder.finish(sequence, state);
}

// `count` completed all_reduce float32[1024].
void all_reduces(FlightRecorder& recorder, int count, OpState last_state = OpState::kCompleted) {
  for (int i = 0; i < count; ++i) {
    add(recorder, "all_reduce", "float32", 1024, {},
        i + 1 == count ? last_state : OpState::kCompleted);
  }
}

void dump_all(const testing::TempDir& dir, const std::vector<const FlightRecorder*>& ranks) {
  for (size_t r = 0; r < ranks.size(); ++r) {
    ranks[r]->dump(flight_dump_file(dir.path(), static_cast<int>(r)), static_cast<int>(r), "world");
  }
}

void write(const std::filesystem::path& path, const std::string& text) {
  std::ofstream(path) << text;
}

using testing::error_of;

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// ---- The recorder -------------------------------------------------------------------------

TEST(FlightRecorder, RingBufferDropsTheOldest) {
  FlightRecorder recorder(3);
  for (uint64_t expected = 1; expected <= 5; ++expected) {
    EXPECT_EQ(recorder.enqueue("all_reduce", "float32", 8, {}), expected);
  }
  std::vector<FlightEntry> entries = recorder.snapshot();
  ASSERT_EQ(entries.size(), 3u);
  EXPECT_EQ(entries[0].sequence, 3u);
  EXPECT_EQ(entries[2].sequence, 5u);
  // A dropped op may still finish on the worker: a no-op, not an error.
  recorder.start(1);
  recorder.finish(2, OpState::kCompleted);
  EXPECT_EQ(recorder.snapshot().size(), 3u);
  EXPECT_THROW(recorder.start(6), InvalidArgument);
  EXPECT_THROW(recorder.finish(0, OpState::kCompleted), InvalidArgument);
  EXPECT_THROW(FlightRecorder(0), InvalidArgument);
}

TEST(FlightRecorder, StatesAndTimestamps) {
  int64_t before = std::chrono::duration_cast<std::chrono::microseconds>(
                       std::chrono::system_clock::now().time_since_epoch())
                       .count();
  FlightRecorder recorder;
  uint64_t a = recorder.enqueue("broadcast", "int64", 4, {2});
  uint64_t b = recorder.enqueue("barrier", "", 0, {});
  FlightEntry entry = recorder.snapshot()[0];
  EXPECT_EQ(entry.state, OpState::kEnqueued);
  EXPECT_GE(entry.enqueue_us, before);
  EXPECT_EQ(entry.start_us, 0);
  recorder.start(a);
  recorder.finish(a, OpState::kCompleted);
  recorder.start(b);
  recorder.finish(b, OpState::kFailed);
  std::vector<FlightEntry> entries = recorder.snapshot();
  EXPECT_EQ(entries[0].state, OpState::kCompleted);
  EXPECT_GE(entries[0].start_us, entries[0].enqueue_us);
  EXPECT_GE(entries[0].end_us, entries[0].start_us);
  EXPECT_EQ(entries[0].peers, std::vector<int>{2});
  EXPECT_EQ(entries[1].state, OpState::kFailed);
  EXPECT_THROW(recorder.finish(a, OpState::kStarted), InvalidArgument);
  EXPECT_STREQ(to_string(OpState::kEnqueued), "enqueued");
  EXPECT_STREQ(to_string(OpState::kFailed), "failed");
}

TEST(FlightRecorder, ConcurrentUseGivesEverySequenceOnce) {
  FlightRecorder recorder(10000);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 500; ++i)
        add(recorder, "all_reduce", "float32", 1, {}, OpState::kCompleted);
    });
  }
  for (std::thread& thread : threads) thread.join();
  std::vector<FlightEntry> entries = recorder.snapshot();
  ASSERT_EQ(entries.size(), 2000u);
  for (size_t i = 0; i < entries.size(); ++i) {
    EXPECT_EQ(entries[i].sequence, i + 1);
    EXPECT_EQ(entries[i].state, OpState::kCompleted);
  }
}

TEST(FlightRecorder, JsonNamesEveryField) {
  FlightRecorder recorder;
  add(recorder, "send", "float32", 16, {3}, OpState::kStarted);
  std::string json = recorder.to_json(2, "dp[0,2]");
  for (const char* part :
       {"\"version\": 1", "\"rank\": 2", "\"group\": \"dp[0,2]\"", "\"capacity\": 2048",
        "\"dumped_us\": ", "\"sequence\":1", "\"op\":\"send\"", "\"dtype\":\"float32\"",
        "\"numel\":16", "\"peers\":[3]", "\"state\":\"started\"", "\"start_us\":"}) {
    EXPECT_TRUE(contains(json, part)) << part << " missing from\n" << json;
  }
}

TEST(FlightRecorder, DumpCreatesDirectoriesAndRoundTrips) {
  testing::TempDir dir;
  FlightRecorder a, b;
  all_reduces(a, 3);
  add(a, "broadcast", "float32", 16, {0}, OpState::kCompleted);
  all_reduces(b, 3);
  add(b, "broadcast", "float32", 16, {0}, OpState::kCompleted);
  a.dump(flight_dump_file(dir / "run" / "flight", 0), 0, "world");
  b.dump(flight_dump_file(dir / "run" / "flight", 1), 1, "world");
  EXPECT_TRUE(std::filesystem::exists(dir / "run/flight/rank_0.json"));
  FlightDiff diff = diff_flight_dumps(dir / "run" / "flight");
  EXPECT_FALSE(diff.diverged) << diff.description;
  EXPECT_EQ(diff.sequence, 4u);
  EXPECT_EQ(diff.ranks, (std::vector<int>{0, 1}));
  EXPECT_EQ(diff.group, "world");
  EXPECT_EQ(diff.description,
            "all 2 ranks agree up to collective #4; the last, #4 (broadcast float32[16] root 0), "
            "completed on every rank");
}

// ---- Divergence ---------------------------------------------------------------------------

TEST(FlightDiff, DifferentOpsAtOneSequence) {
  testing::TempDir dir;
  FlightRecorder r0, r1;
  all_reduces(r0, 6);
  all_reduces(r1, 6);
  add(r0, "all_reduce", "float32", 1024, {}, OpState::kStarted);
  add(r1, "broadcast", "float32", 16, {0}, OpState::kStarted);
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
    add(r[i], "all_reduce", i == 1 ? "bfloat16" : "float32", 1024, {}, OpState::kStarted);
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
  add(r0, "barrier", "", 0, {}, OpState::kStarted);
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
  for (FlightRecorder* r : {&r0, &r1, &r2}) add(*r, "barrier", "", 0, {}, OpState::kEnqueued);
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
  add(r0, "barrier", "", 0, {}, OpState::kEnqueued);
  add(r1, "barrier", "", 0, {}, OpState::kEnqueued);
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
  for (int i = 0; i < 6; ++i) add(large, "broadcast", "float32", 8, {0}, OpState::kCompleted);
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
  add(small, "all_reduce", "float32", 1024, {}, OpState::kStarted);
  add(large, "all_gather", "float32", 1024, {}, OpState::kStarted);
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
  add(r0, "send", "float32", 16, {1}, OpState::kCompleted);
  add(r1, "recv", "float32", 16, {0}, OpState::kCompleted);
  dump_all(dir, {&r0, &r1});
  EXPECT_FALSE(diff_flight_dumps(dir.path()).diverged);

  add(r0, "send", "float32", 16, {1}, OpState::kStarted);
  add(r1, "recv", "float32", 8, {0}, OpState::kStarted);
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

// ---- Bad input ----------------------------------------------------------------------------

TEST(FlightDiff, MissingOrEmptyDirectoryIsIoError) {
  testing::TempDir dir;
  std::string missing = error_of<IoError>([&] { diff_flight_dumps(dir / "nope"); });
  EXPECT_TRUE(contains(missing, "nope")) << missing;
  std::string empty = error_of<IoError>([&] { diff_flight_dumps(dir.path()); });
  EXPECT_TRUE(contains(empty, "no flight dumps")) << empty;
}

TEST(FlightDiff, MalformedDumpsAreCorruptDataNamingTheFile) {
  testing::TempDir dir;
  FlightRecorder r0;
  all_reduces(r0, 2);
  r0.dump(flight_dump_file(dir.path(), 0), 0, "world");

  write(dir / "rank_1.json", "{\"version\": 1, \"rank\": 1,");
  std::string message = error_of<CorruptData>([&] { diff_flight_dumps(dir.path()); });
  EXPECT_TRUE(contains(message, "rank_1.json")) << message;
  EXPECT_TRUE(contains(message, "parse error")) << message;

  write(dir / "rank_1.json",
        R"({"version": 1, "rank": 1, "group": "world", "capacity": 8, "dumped_us": 0,
            "entries": [{"sequence": 1, "dtype": "float32", "numel": 4}]})");
  message = error_of<CorruptData>([&] { diff_flight_dumps(dir.path()); });
  EXPECT_TRUE(contains(message, "rank_1.json: entry 0:")) << message;
  EXPECT_TRUE(contains(message, "'op'")) << message;

  FlightRecorder r1;
  all_reduces(r1, 2);
  write(dir / "rank_1.json", r1.to_json(3, "world"));
  message = error_of<CorruptData>([&] { diff_flight_dumps(dir.path()); });
  EXPECT_TRUE(contains(message, "says rank 3 but the file is named for rank 1")) << message;

  std::string gap = r1.to_json(1, "world");
  gap.replace(gap.find("\"sequence\":2"), 12, "\"sequence\":5");
  write(dir / "rank_1.json", gap);
  message = error_of<CorruptData>([&] { diff_flight_dumps(dir.path()); });
  EXPECT_TRUE(contains(message, "sequence 5 does not follow 1")) << message;
}

TEST(FlightDiff, DumpsOfDifferentGroupsAreRejected) {
  testing::TempDir dir;
  FlightRecorder r0, r1;
  r0.dump(flight_dump_file(dir.path(), 0), 0, "world");
  r1.dump(flight_dump_file(dir.path(), 1), 1, "dp[1,3]");
  std::string message = error_of<InvalidArgument>([&] { diff_flight_dumps(dir.path()); });
  EXPECT_TRUE(contains(message, "different groups")) << message;
  EXPECT_TRUE(contains(message, "dp[1,3]")) << message;
}

}  // namespace
}  // namespace loom::comm
