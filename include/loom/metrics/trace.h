// Traces: a timeline of chosen training steps in the Chrome trace-event JSON format, which
// Perfetto (ui.perfetto.dev) and chrome://tracing open. Each rank writes
// <run_dir>/traces/rank_<r>.json; `loom trace RUN_DIR` merges the ranks into one file with
// their clocks aligned (docs/observability.md).
//
//   metrics::StepTracer tracer(rt, metrics::parse_trace_steps("10-12"));  // every rank
//   for (int64_t step = 0; step < steps; ++step) {
//     tracer.begin_step(step);
//     ...
//   }
//   tracer.flush();
//
// While a chosen step runs (from its begin_step to the next step's), Loom records on the
// threads that do the work: the step and its StepTimer phases (training thread), every
// collective with its group, sequence number and bytes (the group's thread), the checkpoint's
// copy, write and commit (the checkpointer's threads), and the program's own TraceSpans. The
// Trainer does this itself under `metrics.trace_steps`. A span that began while recording is
// kept when it ends after the step.
//
// Clocks: timestamps are microseconds of the system clock (the flight recorder's). Each
// StepTracer measures its clock's offset to rank 0's over the Store at construction, the
// NTP way (the round trip with the smallest delay of several), and `loom trace` applies it.
//
// Cost: when no step is being recorded, every recording site is one relaxed atomic load.
//
// One recording StepTracer per process: spans carry no rank, so ranks run as threads in one
// process cannot each trace (a second StepTracer with steps is InvalidArgument).
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "loom/visibility.h"

namespace loom {
class Runtime;
}

namespace loom::metrics {

// "" -> none; "7" -> {7}; "10-12" -> {10, 11, 12}; "3,10-12" -> {3, 10, 11, 12} (0-based step
// indices, sorted, without repeats). Anything else (a negative step, an empty range, a range
// of more than 100000 steps) is ConfigError naming `spec`.
LOOM_API std::vector<int64_t> parse_trace_steps(const std::string& spec);

// Whether spans are recorded now: a chosen step of a StepTracer is running.
LOOM_API bool tracing();
// The trace clock: microseconds since the Unix epoch (std::chrono::system_clock).
LOOM_API int64_t trace_now_us();
// Records a complete span [start_us, end_us] of `category` on the calling thread when a
// recording StepTracer exists (call it for spans that began while tracing() was true).
// `args_json` is "" or the text of a JSON object shown with the span (other text is kept as
// {"text": ...}); names and args are the caller's, so keep them free of secrets.
LOOM_API void trace_span(const char* category, std::string name, int64_t start_us, int64_t end_us,
                         std::string args_json = {});

// RAII span on the calling thread: recorded when tracing() was true at construction.
// `category` and `name` must outlive the span (string literals).
class LOOM_API TraceSpan {
 public:
  TraceSpan(const char* category, const char* name);
  ~TraceSpan();
  TraceSpan(const TraceSpan&) = delete;
  TraceSpan& operator=(const TraceSpan&) = delete;
  // Arguments shown with the span (the text of a JSON object); ignored when not recording.
  void args(std::string args_json);
  bool recording() const { return start_us_ >= 0; }

 private:
  const char* category_;
  const char* name_;
  int64_t start_us_ = -1;
  std::string args_;
};

// The clock of this rank against rank 0's: rank 0's time = this rank's + offset_us, within
// about uncertainty_us (half the best round trip).
struct ClockOffset {
  double offset_us = 0;
  double uncertainty_us = 0;
};

class LOOM_API StepTracer {
 public:
  // With `steps` empty, does nothing at all. Otherwise collective over rt.store() (every rank
  // constructs one with the same steps): measures the clock offset to rank 0.
  StepTracer(Runtime& rt, std::vector<int64_t> steps);
  // Flushes; a failure is logged, not thrown.
  ~StepTracer();
  StepTracer(const StepTracer&) = delete;
  StepTracer& operator=(const StepTracer&) = delete;

  // Step `step` starts: recording turns on when it is chosen and off when it is not; leaving
  // the chosen steps flushes (a failure to write is logged, not thrown: the training goes on).
  void begin_step(int64_t step);
  // Writes every span recorded so far to file() atomically (nothing when there is none new).
  // IoError naming the file.
  void flush();

  const std::vector<int64_t>& steps() const;
  // <run_dir>/traces/rank_<r>.json.
  const std::filesystem::path& file() const;
  const ClockOffset& clock() const;

 private:
  struct LOOM_HIDDEN Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace loom::metrics
