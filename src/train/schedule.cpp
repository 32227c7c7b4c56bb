// Learning-rate schedules (see schedule.h).
#include "loom/train/schedule.h"

#include <cmath>
#include <sstream>

#include "loom/error.h"

namespace loom::train {

Schedule Schedule::constant(double lr) {
  LOOM_CHECK(std::isfinite(lr) && lr >= 0, InvalidArgument,
             "Schedule::constant: lr must be finite and >= 0, got ", lr);
  WarmupCosineOptions o;
  o.lr = lr;
  o.min_lr = lr;
  return Schedule(Kind::kConstant, o);
}

Schedule Schedule::warmup_cosine(const WarmupCosineOptions& o) {
  LOOM_CHECK(std::isfinite(o.lr) && std::isfinite(o.min_lr) && o.min_lr >= 0 && o.min_lr <= o.lr,
             InvalidArgument, "Schedule::warmup_cosine: need 0 <= min_lr <= lr, got min_lr ",
             o.min_lr, " and lr ", o.lr);
  LOOM_CHECK(o.total_steps > 0 && o.warmup_steps >= 0 && o.warmup_steps <= o.total_steps,
             InvalidArgument,
             "Schedule::warmup_cosine: need 0 <= warmup_steps <= total_steps and total_steps > 0, "
             "got warmup_steps ",
             o.warmup_steps, " and total_steps ", o.total_steps);
  return Schedule(Kind::kWarmupCosine, o);
}

double Schedule::operator()(int64_t step) const {
  LOOM_CHECK(step >= 0, InvalidArgument, "Schedule: step must be >= 0, got ", step);
  const WarmupCosineOptions& o = options_;
  if (kind_ == Kind::kConstant) return o.lr;
  if (step < o.warmup_steps) {
    return o.lr * static_cast<double>(step + 1) / static_cast<double>(o.warmup_steps);
  }
  if (step >= o.total_steps) return o.min_lr;
  const double progress = static_cast<double>(step - o.warmup_steps) /
                          static_cast<double>(o.total_steps - o.warmup_steps);
  return o.min_lr + (o.lr - o.min_lr) * 0.5 * (1.0 + std::cos(M_PI * progress));
}

std::string Schedule::describe() const {
  std::ostringstream out;
  if (kind_ == Kind::kConstant) {
    out << "constant(lr=" << options_.lr << ")";
  } else {
    out << "warmup_cosine(lr=" << options_.lr << ", min_lr=" << options_.min_lr
        << ", warmup=" << options_.warmup_steps << ", total=" << options_.total_steps << ")";
  }
  return out.str();
}

}  // namespace loom::train
