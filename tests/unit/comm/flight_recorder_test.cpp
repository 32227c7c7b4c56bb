// The flight recorder's ring buffer and states, its JSON dump, and reading dumps back
// (read_flight_dumps), bad dumps included. The cross-rank diff is tested in unit/cli.
#include "loom/comm/flight_recorder.h"

#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <thread>

#include "harness/harness.h"
#include "loom/error.h"
#include "unit/comm/flight_ops.h"

namespace loom::comm {
namespace {

using testing::add_op;
using testing::all_reduces;
using testing::contains;
using testing::error_of;

void write(const std::filesystem::path& path, const std::string& text) {
  std::ofstream(path) << text;
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
        add_op(recorder, "all_reduce", "float32", 1, {}, OpState::kCompleted);
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
  add_op(recorder, "send", "float32", 16, {3}, OpState::kStarted);
  std::string json = recorder.to_json(2, "dp[0,2]");
  for (const char* part :
       {"\"version\": 1", "\"rank\": 2", "\"group\": \"dp[0,2]\"", "\"capacity\": 2048",
        "\"dumped_us\": ", "\"sequence\":1", "\"op\":\"send\"", "\"dtype\":\"float32\"",
        "\"numel\":16", "\"peers\":[3]", "\"state\":\"started\"", "\"start_us\":"}) {
    EXPECT_TRUE(contains(json, part)) << part << " missing from\n" << json;
  }
}

TEST(FlightRecorder, DumpCreatesDirectoriesAndReadsBackEveryField) {
  testing::TempDir dir;
  FlightRecorder a, b;
  all_reduces(a, 3);
  add_op(a, "broadcast", "float32", 16, {0}, OpState::kCompleted);
  add_op(b, "send", "int64", 4, {0}, OpState::kStarted);
  add_op(b, "barrier", "", 0, {}, OpState::kEnqueued);
  a.dump(flight_dump_file(dir / "run" / "flight", 0), 0, "world");
  b.dump(flight_dump_file(dir / "run" / "flight", 1), 1, "world");
  EXPECT_TRUE(std::filesystem::exists(dir / "run/flight/rank_0.json"));
  std::vector<FlightDump> dumps = read_flight_dumps(dir / "run" / "flight");
  ASSERT_EQ(dumps.size(), 2u);
  const FlightRecorder* recorders[] = {&a, &b};
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(dumps[r].rank, r);
    EXPECT_EQ(dumps[r].file, flight_dump_file(dir / "run" / "flight", r));
    EXPECT_EQ(dumps[r].group, "world");
    const std::vector<FlightEntry> expected = recorders[r]->snapshot();
    ASSERT_EQ(dumps[r].entries.size(), expected.size());
    for (size_t i = 0; i < expected.size(); ++i) {
      const FlightEntry& got = dumps[r].entries[i];
      const FlightEntry& want = expected[i];
      EXPECT_EQ(got.sequence, want.sequence);
      EXPECT_EQ(got.op, want.op);
      EXPECT_EQ(got.dtype, want.dtype);
      EXPECT_EQ(got.numel, want.numel);
      EXPECT_EQ(got.peers, want.peers);
      EXPECT_EQ(got.enqueue_us, want.enqueue_us);
      EXPECT_EQ(got.start_us, want.start_us);
      EXPECT_EQ(got.end_us, want.end_us);
      EXPECT_EQ(got.state, want.state);
    }
  }
}

TEST(FlightDumps, OtherFileNamesAreIgnored) {
  testing::TempDir dir;
  FlightRecorder r2;
  all_reduces(r2, 2);
  r2.dump(flight_dump_file(dir.path(), 2), 2, "world");
  write(dir / "rank_1.json.tmp", "partial");
  write(dir / "notes.txt", "x");
  write(dir / "rank_x.json", "{}");
  std::vector<FlightDump> dumps = read_flight_dumps(dir.path());
  ASSERT_EQ(dumps.size(), 1u);
  EXPECT_EQ(dumps[0].rank, 2);
  EXPECT_EQ(dumps[0].entries.size(), 2u);
}

// ---- Bad input ----------------------------------------------------------------------------

TEST(FlightDumps, MissingOrEmptyDirectoryIsIoError) {
  testing::TempDir dir;
  std::string missing = error_of<IoError>([&] { read_flight_dumps(dir / "nope"); });
  EXPECT_TRUE(contains(missing, "nope")) << missing;
  std::string empty = error_of<IoError>([&] { read_flight_dumps(dir.path()); });
  EXPECT_TRUE(contains(empty, "no flight dumps")) << empty;
}

TEST(FlightDumps, MalformedDumpsAreCorruptDataNamingTheFile) {
  testing::TempDir dir;
  FlightRecorder r0;
  all_reduces(r0, 2);
  r0.dump(flight_dump_file(dir.path(), 0), 0, "world");

  write(dir / "rank_1.json", "{\"version\": 1, \"rank\": 1,");
  std::string message = error_of<CorruptData>([&] { read_flight_dumps(dir.path()); });
  EXPECT_TRUE(contains(message, "rank_1.json")) << message;
  EXPECT_TRUE(contains(message, "parse error")) << message;

  write(dir / "rank_1.json",
        R"({"version": 1, "rank": 1, "group": "world", "capacity": 8, "dumped_us": 0,
            "entries": [{"sequence": 1, "dtype": "float32", "numel": 4}]})");
  message = error_of<CorruptData>([&] { read_flight_dumps(dir.path()); });
  EXPECT_TRUE(contains(message, "rank_1.json: entry 0:")) << message;
  EXPECT_TRUE(contains(message, "'op'")) << message;

  FlightRecorder r1;
  all_reduces(r1, 2);
  write(dir / "rank_1.json", r1.to_json(3, "world"));
  message = error_of<CorruptData>([&] { read_flight_dumps(dir.path()); });
  EXPECT_TRUE(contains(message, "says rank 3 but the file is named for rank 1")) << message;

  std::string gap = r1.to_json(1, "world");
  gap.replace(gap.find("\"sequence\":2"), 12, "\"sequence\":5");
  write(dir / "rank_1.json", gap);
  message = error_of<CorruptData>([&] { read_flight_dumps(dir.path()); });
  EXPECT_TRUE(contains(message, "sequence 5 does not follow 1")) << message;
}

TEST(FlightDumps, DumpsOfDifferentGroupsAreRejected) {
  testing::TempDir dir;
  FlightRecorder r0, r1;
  r0.dump(flight_dump_file(dir.path(), 0), 0, "world");
  r1.dump(flight_dump_file(dir.path(), 1), 1, "dp[1,3]");
  std::string message = error_of<InvalidArgument>([&] { read_flight_dumps(dir.path()); });
  EXPECT_TRUE(contains(message, "different groups")) << message;
  EXPECT_TRUE(contains(message, "dp[1,3]")) << message;
}

}  // namespace
}  // namespace loom::comm
