// metrics::StepTimer: where each training step's time goes. The step is cut into named
// phases (data wait, forward/backward, communication wait, optimizer, checkpoint stall); the
// rest of the step is "other", so the phases of a step always sum to its wall time.
//
//   metrics::StepTimer timer;
//   timer.begin_step();
//   { auto phase = timer.phase(metrics::Phase::kDataWait); batch = reader->next(); }
//   { auto phase = timer.phase(metrics::Phase::kForwardBackward); loss.backward(); }
//   metrics::StepTimes times = timer.end_step();
//
// Phases nest: time inside an inner phase counts for the inner phase only (exclusive time),
// so a communication wait inside forward/backward is not counted twice.
//
// While a StepTracer records (loom/metrics/trace.h), each step and each phase is also a trace
// span on the calling thread.
//
// Thread safety: one thread (the training loop) uses a StepTimer. Not copyable.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "loom/visibility.h"

namespace loom::metrics {

enum class Phase {
  kDataWait,         // waiting for the next batch (Reader::next)
  kForwardBackward,  // forward and backward compute
  kCommWait,         // waiting for collectives (gradient all-reduce not hidden by backward)
  kOptimizer,        // gradient clipping and optimizer step
  kCheckpointStall,  // the training thread blocked by a checkpoint (the snapshot copy)
  kOther,            // everything else in the step (logging, the rest of the loop)
};
inline constexpr size_t kNumPhases = 6;

// "data_wait", "forward_backward", "comm_wait", "optimizer", "checkpoint_stall", "other":
// the names metrics.jsonl uses.
LOOM_API const char* to_string(Phase phase);

// One step's time per phase, in seconds.
struct StepTimes {
  std::array<double, kNumPhases> seconds{};  // indexed by Phase
  double total = 0;                          // wall time from begin_step to end_step

  double operator[](Phase phase) const { return seconds[static_cast<size_t>(phase)]; }
  double& operator[](Phase phase) { return seconds[static_cast<size_t>(phase)]; }
};

class LOOM_API StepTimer {
 public:
  using Clock = std::function<std::chrono::steady_clock::time_point()>;

  // `clock` is for tests; the default is std::chrono::steady_clock::now.
  explicit StepTimer(Clock clock = {});
  StepTimer(const StepTimer&) = delete;
  StepTimer& operator=(const StepTimer&) = delete;

  // RAII: the phase runs from construction to destruction (or stop()). Movable.
  class Scope {
   public:
    Scope(Scope&& other) noexcept;
    Scope& operator=(Scope&&) = delete;
    ~Scope();
    void stop();  // ends the phase early; idempotent

   private:
    friend class StepTimer;
    explicit Scope(StepTimer* timer) : timer_(timer) {}
    StepTimer* timer_;
  };

  // Starts a step. A step already open is InvalidArgument (end_step was missed).
  void begin_step();
  // Opens `phase` until the returned Scope ends. Outside a step is InvalidArgument.
  [[nodiscard]] Scope phase(Phase phase);
  // Ends the step: time not inside any phase is added to kOther. Open scopes are
  // InvalidArgument (a Scope outlived its step).
  StepTimes end_step();
  bool in_step() const { return in_step_; }

 private:
  void push(Phase phase);
  void pop();
  void charge(std::chrono::steady_clock::time_point now);  // elapsed since mark_ -> top phase

  Clock clock_;
  bool in_step_ = false;
  std::chrono::steady_clock::time_point step_start_;
  std::chrono::steady_clock::time_point mark_;
  std::vector<Phase> open_;  // nested phases, innermost last
  // When each open phase and the step began on the trace clock; -1: not traced.
  std::vector<int64_t> trace_start_us_;
  int64_t trace_step_start_us_ = -1;
  StepTimes current_;
};

}  // namespace loom::metrics
