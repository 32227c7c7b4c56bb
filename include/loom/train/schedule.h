// train::Schedule: the learning rate as a pure function of the step.
//
//   auto schedule = train::Schedule::warmup_cosine({.lr = 6e-4, .min_lr = 6e-5,
//                                                   .warmup_steps = 100, .total_steps = 5000});
//   double lr = schedule(step);   // step counts from 0
//
// Immutable and cheap to copy; safe to share between threads.
#pragma once

#include <cstdint>
#include <string>

#include "loom/visibility.h"

namespace loom::train {

struct WarmupCosineOptions {
  double lr = 3e-4;          // the peak learning rate, reached at the end of warmup
  double min_lr = 0;         // where the cosine ends, and the rate after total_steps
  int64_t warmup_steps = 0;  // linear from lr / warmup_steps (step 0) up to lr
  int64_t total_steps = 0;   // warmup plus decay; steps at or past it get min_lr
};

class LOOM_API Schedule {
 public:
  // lr at every step. A negative or non-finite lr is InvalidArgument.
  static Schedule constant(double lr);
  // Linear warmup then cosine decay (the GPT-2/nanoGPT/llm.c schedule):
  //   step < W:      lr * (step + 1) / W
  //   W <= step < S: min_lr + (lr - min_lr) * (1 + cos(pi * (step - W) / (S - W))) / 2
  //   step >= S:     min_lr
  // Needs 0 <= min_lr <= lr, 0 <= W <= S and S > 0; otherwise InvalidArgument.
  static Schedule warmup_cosine(const WarmupCosineOptions& options);

  // The learning rate at `step` (>= 0; a negative step is InvalidArgument).
  double operator()(int64_t step) const;
  // The peak rate: the constant's lr, or warmup_cosine's lr.
  double peak() const { return options_.lr; }
  // E.g. "warmup_cosine(lr=0.0006, min_lr=6e-05, warmup=100, total=5000)".
  std::string describe() const;

 private:
  enum class Kind { kConstant, kWarmupCosine };
  Schedule(Kind kind, WarmupCosineOptions options) : kind_(kind), options_(options) {}
  Kind kind_;
  WarmupCosineOptions options_;
};

}  // namespace loom::train
