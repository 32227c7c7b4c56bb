// StepTimer: phases are exclusive, sum to the step's wall time, and misuse is reported; the
// process-wide current activity (metrics/activity.h) follows the innermost open phase.
#include "loom/metrics/step_timer.h"

#include <gtest/gtest.h>

#include <thread>

#include "loom/error.h"
#include "metrics/activity.h"

namespace loom::metrics {
namespace {

using std::chrono::milliseconds;

// A clock the test advances by hand.
struct FakeClock {
  std::chrono::steady_clock::time_point now{};
  void advance(int ms) { now += milliseconds(ms); }
  StepTimer::Clock fn() {
    return [this] { return now; };
  }
};

TEST(StepTimer, PhasesSumToTheStepAndTheRestIsOther) {
  FakeClock clock;
  StepTimer timer(clock.fn());
  timer.begin_step();
  clock.advance(5);  // before any phase: other
  {
    auto p = timer.phase(Phase::kDataWait);
    clock.advance(20);
  }
  {
    auto p = timer.phase(Phase::kForwardBackward);
    clock.advance(100);
  }
  {
    auto p = timer.phase(Phase::kOptimizer);
    clock.advance(30);
  }
  clock.advance(7);
  StepTimes t = timer.end_step();
  EXPECT_DOUBLE_EQ(t.total, 0.162);
  EXPECT_DOUBLE_EQ(t[Phase::kDataWait], 0.020);
  EXPECT_DOUBLE_EQ(t[Phase::kForwardBackward], 0.100);
  EXPECT_DOUBLE_EQ(t[Phase::kOptimizer], 0.030);
  EXPECT_DOUBLE_EQ(t[Phase::kOther], 0.012);
  EXPECT_DOUBLE_EQ(t[Phase::kCommWait], 0.0);
  double sum = 0;
  for (double s : t.seconds) sum += s;
  EXPECT_NEAR(sum, t.total, 1e-12);
}

TEST(StepTimer, NestedPhaseTimeCountsOnlyForTheInnerPhase) {
  FakeClock clock;
  StepTimer timer(clock.fn());
  timer.begin_step();
  {
    auto fb = timer.phase(Phase::kForwardBackward);
    clock.advance(40);
    {
      auto comm = timer.phase(Phase::kCommWait);
      clock.advance(15);
    }
    clock.advance(10);
  }
  StepTimes t = timer.end_step();
  EXPECT_DOUBLE_EQ(t[Phase::kForwardBackward], 0.050);
  EXPECT_DOUBLE_EQ(t[Phase::kCommWait], 0.015);
  EXPECT_DOUBLE_EQ(t.total, 0.065);
}

TEST(StepTimer, StopEndsAPhaseEarlyAndMovedScopesEndOnce) {
  FakeClock clock;
  StepTimer timer(clock.fn());
  timer.begin_step();
  auto p = timer.phase(Phase::kCheckpointStall);
  clock.advance(8);
  auto moved = std::move(p);
  moved.stop();
  moved.stop();
  clock.advance(2);
  StepTimes t = timer.end_step();
  EXPECT_DOUBLE_EQ(t[Phase::kCheckpointStall], 0.008);
  EXPECT_DOUBLE_EQ(t[Phase::kOther], 0.002);
}

TEST(StepTimer, StepsAreIndependent) {
  FakeClock clock;
  StepTimer timer(clock.fn());
  for (int step = 0; step < 3; ++step) {
    timer.begin_step();
    {
      auto p = timer.phase(Phase::kDataWait);
      clock.advance(10);
    }
    clock.advance(1);  // between steps: not in any step
    StepTimes t = timer.end_step();
    EXPECT_DOUBLE_EQ(t[Phase::kDataWait], 0.010);
    EXPECT_DOUBLE_EQ(t.total, 0.011);
    clock.advance(50);
  }
}

TEST(StepTimer, MisuseIsInvalidArgument) {
  StepTimer timer;
  EXPECT_THROW((void)timer.phase(Phase::kDataWait), InvalidArgument);
  EXPECT_THROW(timer.end_step(), InvalidArgument);
  timer.begin_step();
  EXPECT_THROW(timer.begin_step(), InvalidArgument);
  {
    auto p = timer.phase(Phase::kOptimizer);
    EXPECT_THROW(timer.end_step(), InvalidArgument);
  }
  EXPECT_NO_THROW(timer.end_step());
}

TEST(StepTimer, RealClockPhasesSumToTotal) {
  StepTimer timer;
  timer.begin_step();
  {
    auto p = timer.phase(Phase::kForwardBackward);
    volatile double x = 0;
    for (int i = 0; i < 100000; ++i) x = x + i;
  }
  StepTimes t = timer.end_step();
  double sum = 0;
  for (double s : t.seconds) sum += s;
  EXPECT_GT(t.total, 0);
  EXPECT_NEAR(sum, t.total, 1e-9);
}

TEST(StepTimer, CurrentActivityIsTheInnermostOpenPhaseOrBetweenSteps) {
  // Process-wide: earlier tests of this binary may have run a timer, so nothing is assumed
  // before this one's first step.
  StepTimer timer;
  timer.begin_step();
  EXPECT_STREQ(current_activity(), "other");
  {
    auto outer = timer.phase(Phase::kForwardBackward);
    EXPECT_STREQ(current_activity(), "forward_backward");
    {
      auto inner = timer.phase(Phase::kCommWait);
      EXPECT_STREQ(current_activity(), "comm_wait");
    }
    EXPECT_STREQ(current_activity(), "forward_backward");
  }
  EXPECT_STREQ(current_activity(), "other");
  timer.end_step();
  EXPECT_STREQ(current_activity(), "between_steps");
  // Another thread (the heartbeat's) reads the same.
  const char* seen = nullptr;
  std::thread([&] { seen = current_activity(); }).join();
  EXPECT_STREQ(seen, "between_steps");
}

TEST(StepTimer, PhaseNames) {
  EXPECT_STREQ(to_string(Phase::kDataWait), "data_wait");
  EXPECT_STREQ(to_string(Phase::kForwardBackward), "forward_backward");
  EXPECT_STREQ(to_string(Phase::kCommWait), "comm_wait");
  EXPECT_STREQ(to_string(Phase::kOptimizer), "optimizer");
  EXPECT_STREQ(to_string(Phase::kCheckpointStall), "checkpoint_stall");
  EXPECT_STREQ(to_string(Phase::kOther), "other");
}

}  // namespace
}  // namespace loom::metrics
