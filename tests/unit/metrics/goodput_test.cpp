// GoodputTracker: the account across simulated restarts (two trackers over one run dir).
#include "loom/metrics/goodput.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fstream>

#include "harness/harness.h"
#include "loom/error.h"
#include "util/files.h"

namespace loom::metrics {
namespace {

struct FakeClock {
  std::chrono::steady_clock::time_point now{};
  void advance(double seconds) {
    now += std::chrono::duration_cast<std::chrono::steady_clock::duration>(
        std::chrono::duration<double>(seconds));
  }
};

GoodputOptions with_clock(FakeClock& clock) {
  GoodputOptions o;
  o.clock = [&clock] { return clock.now; };
  return o;
}

// Runs steps [first, last] of `seconds` each, advancing the clock by the same.
void run_steps(GoodputTracker& t, FakeClock& clock, int64_t first, int64_t last, double seconds) {
  for (int64_t s = first; s <= last; ++s) {
    clock.advance(seconds);
    t.on_step(s, seconds);
  }
}

TEST(Goodput, OneSessionWithoutRestartCountsEveryStep) {
  testing::TempDir dir;
  FakeClock clock;
  GoodputTracker t(dir.path(), with_clock(clock));
  clock.advance(10);  // start-up
  run_steps(t, clock, 0, 9, 2.0);
  GoodputReport r = t.report();
  EXPECT_DOUBLE_EQ(r.wall_seconds, 30);
  EXPECT_DOUBLE_EQ(r.productive_seconds, 20);
  EXPECT_DOUBLE_EQ(r.lost_seconds, 0);
  EXPECT_DOUBLE_EQ(r.goodput, 20.0 / 30.0);
  EXPECT_EQ(r.sessions, 1);
}

TEST(Goodput, StepsAfterTheLastCheckpointAreLostAtARestart) {
  testing::TempDir dir;
  FakeClock clock;
  {
    GoodputTracker first(dir.path(), with_clock(clock));
    clock.advance(10);
    first.on_resume(0);
    run_steps(first, clock, 0, 9, 1.0);    // steps 0-9
    first.on_checkpoint_committed(10);     // holds steps 0-9
    run_steps(first, clock, 10, 14, 1.0);  // steps 10-14: not checkpointed
    clock.advance(1);
    // The process dies here; its destructor flushes as the last periodic flush would.
  }
  const nlohmann::json saved = nlohmann::json::parse(util::read_file(dir / "goodput.json"));
  EXPECT_DOUBLE_EQ(saved["wall_seconds"].get<double>(), 26);
  EXPECT_EQ(saved["pending"]["first_step"], 10);
  EXPECT_EQ(saved["pending"]["last_step"], 14);

  GoodputTracker second(dir.path(), with_clock(clock));
  // Before the resume is known, the pending steps still count (the job might not restart).
  EXPECT_DOUBLE_EQ(second.report().productive_seconds, 15);
  clock.advance(4);  // restart cost: loading the checkpoint
  second.on_resume(10);
  run_steps(second, clock, 10, 19, 1.0);  // steps 10-19, 10-14 re-done
  GoodputReport r = second.report();
  EXPECT_EQ(r.sessions, 2);
  EXPECT_DOUBLE_EQ(r.wall_seconds, 26 + 14);
  EXPECT_DOUBLE_EQ(r.lost_seconds, 5);
  EXPECT_DOUBLE_EQ(r.productive_seconds, 20);  // steps 0-19 once each
  EXPECT_DOUBLE_EQ(r.goodput, 20.0 / 40.0);
}

TEST(Goodput, TheFirstStepImpliesTheResumePoint) {
  testing::TempDir dir;
  FakeClock clock;
  {
    GoodputTracker first(dir.path(), with_clock(clock));
    run_steps(first, clock, 0, 9, 1.0);
    first.on_checkpoint_committed(5);
  }
  GoodputTracker second(dir.path(), with_clock(clock));
  run_steps(second, clock, 5, 9, 1.0);  // no on_resume: the first step says 5
  EXPECT_DOUBLE_EQ(second.report().lost_seconds, 5);
  EXPECT_DOUBLE_EQ(second.report().productive_seconds, 10);
}

TEST(Goodput, ResumingFromAnOlderCheckpointLosesTheLaterCommits) {
  testing::TempDir dir;
  FakeClock clock;
  {
    GoodputTracker first(dir.path(), with_clock(clock));
    run_steps(first, clock, 0, 9, 1.0);
    first.on_checkpoint_committed(4);
    first.on_checkpoint_committed(8);
    run_steps(first, clock, 10, 11, 1.0);
  }
  GoodputTracker second(dir.path(), with_clock(clock));
  second.on_resume(4);  // the step-8 checkpoint was bad, say
  GoodputReport r = second.report();
  EXPECT_DOUBLE_EQ(r.productive_seconds, 4);
  EXPECT_DOUBLE_EQ(r.lost_seconds, 8);  // steps 4-7 (committed), 8-11 (pending)
}

TEST(Goodput, AsyncCommitCoversOnlyTheStepsItHolds) {
  testing::TempDir dir;
  FakeClock clock;
  {
    GoodputTracker first(dir.path(), with_clock(clock));
    run_steps(first, clock, 0, 12, 1.0);
    first.on_checkpoint_committed(10);  // saved after step 9, durable during step 12
  }
  GoodputTracker second(dir.path(), with_clock(clock));
  second.on_resume(10);
  EXPECT_DOUBLE_EQ(second.report().productive_seconds, 10);
  EXPECT_DOUBLE_EQ(second.report().lost_seconds, 3);
}

TEST(Goodput, AnUnrecordedCommitIsProratedByStepCount) {
  testing::TempDir dir;
  FakeClock clock;
  {
    GoodputTracker first(dir.path(), with_clock(clock));
    run_steps(first, clock, 0, 9, 2.0);
  }
  GoodputTracker second(dir.path(), with_clock(clock));
  second.on_resume(6);  // a checkpoint at 6 exists, but its commit never reached the account
  EXPECT_DOUBLE_EQ(second.report().productive_seconds, 12);
  EXPECT_DOUBLE_EQ(second.report().lost_seconds, 8);
}

TEST(Goodput, PeriodicFlushOnlyAfterTheInterval) {
  testing::TempDir dir;
  FakeClock clock;
  GoodputOptions o = with_clock(clock);
  o.flush_interval = std::chrono::seconds(10);
  GoodputTracker t(dir.path(), o);
  run_steps(t, clock, 0, 3, 1.0);
  EXPECT_FALSE(std::filesystem::exists(t.file()));
  run_steps(t, clock, 4, 10, 1.0);
  EXPECT_TRUE(std::filesystem::exists(t.file()));
}

TEST(Goodput, WithoutPersistNothingIsWritten) {
  testing::TempDir dir;
  {
    GoodputOptions o;
    o.persist = false;
    GoodputTracker t(dir.path(), o);
    t.on_step(0, 0.5);
    t.on_checkpoint_committed(1);
  }
  EXPECT_FALSE(std::filesystem::exists(dir / "goodput.json"));
}

TEST(Goodput, MisuseAndCorruptFiles) {
  testing::TempDir dir;
  {
    GoodputTracker t(dir.path());
    t.on_step(3, 1.0);
    EXPECT_THROW(t.on_step(3, 1.0), InvalidArgument);
    EXPECT_THROW(t.on_step(4, -1.0), InvalidArgument);
  }
  std::ofstream(dir / "goodput.json") << "{ not json";
  const std::string message = testing::error_of<CorruptData>([&] { GoodputTracker t(dir.path()); });
  EXPECT_NE(message.find("goodput.json"), std::string::npos) << message;
  EXPECT_NE(message.find("delete it"), std::string::npos) << message;
}

}  // namespace
}  // namespace loom::metrics
