// Learning-rate schedules as pure functions of the step.
#include "loom/train/schedule.h"

#include <gtest/gtest.h>

#include <cmath>

#include "loom/error.h"

namespace loom::train {
namespace {

TEST(Schedule, ConstantIsTheSameAtEveryStep) {
  const Schedule s = Schedule::constant(3e-4);
  for (int64_t step : {0, 1, 100, 1000000}) EXPECT_DOUBLE_EQ(s(step), 3e-4);
  EXPECT_EQ(s.describe(), "constant(lr=0.0003)");
}

TEST(Schedule, WarmupIsLinearFromLrOverWarmup) {
  const Schedule s =
      Schedule::warmup_cosine({.lr = 1e-3, .min_lr = 1e-4, .warmup_steps = 10, .total_steps = 110});
  EXPECT_DOUBLE_EQ(s(0), 1e-4);
  EXPECT_DOUBLE_EQ(s(4), 5e-4);
  EXPECT_DOUBLE_EQ(s(9), 1e-3);
  EXPECT_DOUBLE_EQ(s(10), 1e-3);  // the cosine starts at its peak
}

TEST(Schedule, CosineReachesHalfwayAtTheMiddleAndMinLrAtTheEnd) {
  const Schedule s =
      Schedule::warmup_cosine({.lr = 1e-3, .min_lr = 1e-4, .warmup_steps = 10, .total_steps = 110});
  EXPECT_NEAR(s(60), 5.5e-4, 1e-15);  // half of the decay: (lr + min_lr) / 2
  EXPECT_NEAR(s(35), 1e-4 + 9e-4 * 0.5 * (1 + std::cos(M_PI * 0.25)), 1e-15);
  EXPECT_DOUBLE_EQ(s(110), 1e-4);
  EXPECT_DOUBLE_EQ(s(1000), 1e-4);
  for (int64_t step = 10; step < 110; ++step) EXPECT_GE(s(step), s(step + 1)) << step;
  for (int64_t step = 0; step < 9; ++step) EXPECT_LT(s(step), s(step + 1)) << step;
}

TEST(Schedule, NoWarmupStartsAtLr) {
  const Schedule s =
      Schedule::warmup_cosine({.lr = 2.0, .min_lr = 0.0, .warmup_steps = 0, .total_steps = 4});
  EXPECT_DOUBLE_EQ(s(0), 2.0);
  EXPECT_NEAR(s(2), 1.0, 1e-15);
  EXPECT_DOUBLE_EQ(s(4), 0.0);
}

TEST(Schedule, IsAPureFunctionOfTheStep) {
  const Schedule s = Schedule::warmup_cosine(
      {.lr = 6e-4, .min_lr = 6e-5, .warmup_steps = 100, .total_steps = 5000});
  const Schedule copy = s;
  for (int64_t step : {4999, 0, 2500, 100, 2500}) EXPECT_DOUBLE_EQ(s(step), copy(step));
  EXPECT_EQ(s.describe(), "warmup_cosine(lr=0.0006, min_lr=6e-05, warmup=100, total=5000)");
}

TEST(Schedule, BadOptionsAreInvalidArgument) {
  EXPECT_THROW(Schedule::constant(-1), InvalidArgument);
  EXPECT_THROW(Schedule::constant(NAN), InvalidArgument);
  EXPECT_THROW(Schedule::warmup_cosine({.lr = 1e-4, .min_lr = 1e-3, .total_steps = 10}),
               InvalidArgument);
  EXPECT_THROW(Schedule::warmup_cosine({.lr = 1e-3, .warmup_steps = 11, .total_steps = 10}),
               InvalidArgument);
  EXPECT_THROW(Schedule::warmup_cosine({.lr = 1e-3, .total_steps = 0}), InvalidArgument);
  EXPECT_THROW(Schedule::constant(1e-3)(-1), InvalidArgument);
}

}  // namespace
}  // namespace loom::train
