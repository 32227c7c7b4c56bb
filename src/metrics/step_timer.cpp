// Per-step phase timing with exclusive (innermost-phase) accounting (see step_timer.h).
#include "loom/metrics/step_timer.h"

#include <atomic>

#include "loom/error.h"
#include "loom/metrics/trace.h"
#include "metrics/activity.h"
#include "metrics/trace_internal.h"

namespace loom::metrics {
namespace {

// What current_activity() returns: kNoTimer, kBetweenSteps, or a Phase's index.
constexpr int kNoTimer = -2;
constexpr int kBetweenSteps = -1;
std::atomic<int> g_activity{kNoTimer};

// A timer's state as current_activity() reports it.
void publish(bool in_step, const std::vector<Phase>& open) {
  g_activity.store(!in_step       ? kBetweenSteps
                   : open.empty() ? static_cast<int>(Phase::kOther)
                                  : static_cast<int>(open.back()),
                   std::memory_order_relaxed);
}

}  // namespace

const char* current_activity() {
  const int a = g_activity.load(std::memory_order_relaxed);
  if (a == kNoTimer) return "";
  if (a == kBetweenSteps) return "between_steps";
  return to_string(static_cast<Phase>(a));
}

const char* to_string(Phase phase) {
  switch (phase) {
    case Phase::kDataWait:
      return "data_wait";
    case Phase::kForwardBackward:
      return "forward_backward";
    case Phase::kCommWait:
      return "comm_wait";
    case Phase::kOptimizer:
      return "optimizer";
    case Phase::kCheckpointStall:
      return "checkpoint_stall";
    case Phase::kOther:
      return "other";
  }
  return "unknown";
}

StepTimer::StepTimer(Clock clock)
    : clock_(clock ? std::move(clock) : Clock([] { return std::chrono::steady_clock::now(); })) {}

StepTimer::Scope::Scope(Scope&& other) noexcept : timer_(other.timer_) { other.timer_ = nullptr; }

StepTimer::Scope::~Scope() { stop(); }

void StepTimer::Scope::stop() {
  if (timer_ == nullptr) return;
  StepTimer* timer = timer_;
  timer_ = nullptr;
  timer->pop();
}

void StepTimer::begin_step() {
  LOOM_CHECK(!in_step_, InvalidArgument,
             "StepTimer::begin_step: the previous step was not ended (call end_step first)");
  in_step_ = true;
  current_ = StepTimes{};
  step_start_ = clock_();
  mark_ = step_start_;
  trace_step_start_us_ = tracing() ? trace_now_us() : -1;
  publish(in_step_, open_);
}

StepTimer::Scope StepTimer::phase(Phase phase) {
  push(phase);
  return Scope(this);
}

void StepTimer::charge(std::chrono::steady_clock::time_point now) {
  const Phase top = open_.empty() ? Phase::kOther : open_.back();
  current_[top] += std::chrono::duration<double>(now - mark_).count();
  mark_ = now;
}

void StepTimer::push(Phase phase) {
  LOOM_CHECK(in_step_, InvalidArgument, "StepTimer::phase(", to_string(phase),
             ") outside a step: call begin_step first");
  charge(clock_());
  open_.push_back(phase);
  trace_start_us_.push_back(tracing() ? trace_now_us() : -1);
  publish(in_step_, open_);
}

void StepTimer::pop() {
  // A Scope only exists after a successful push, so open_ is not empty here.
  charge(clock_());
  if (trace_start_us_.back() >= 0) {
    trace_span("phase", to_string(open_.back()), trace_start_us_.back(), trace_now_us());
  }
  trace_start_us_.pop_back();
  open_.pop_back();
  publish(in_step_, open_);
}

StepTimes StepTimer::end_step() {
  LOOM_CHECK(in_step_, InvalidArgument, "StepTimer::end_step without begin_step");
  LOOM_CHECK(open_.empty(), InvalidArgument, "StepTimer::end_step while phase ",
             to_string(open_.back()), " is still open (a Scope outlived its step)");
  const auto now = clock_();
  charge(now);
  current_.total = std::chrono::duration<double>(now - step_start_).count();
  in_step_ = false;
  if (trace_step_start_us_ >= 0) {
    const int64_t step = internal::traced_step();
    trace_span("step", step >= 0 ? "step " + std::to_string(step) : std::string("step"),
               trace_step_start_us_, trace_now_us(),
               step >= 0 ? "{\"step\":" + std::to_string(step) + "}" : "");
  }
  publish(in_step_, open_);
  return current_;
}

}  // namespace loom::metrics
