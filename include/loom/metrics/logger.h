// metrics::MetricsLogger: per-step training metrics. It turns what the trainer reports each
// step (loss, lr, tokens, phase times...) into throughput, MFU, goodput and memory, appends
// one JSON object per step to <run_dir>/metrics.jsonl, and keeps a live progress line on the
// terminal. Every field is described in docs/metrics.md.
//
//   metrics::MetricsLogger metrics(rt, {.flops_per_token = model->flops_per_token(),
//                                       .peak = metrics::peak_flops(rt.device())});
//   metrics.on_resume(start_step);
//   for (step ...) {
//     metrics.timer().begin_step();
//     { auto p = metrics.timer().phase(metrics::Phase::kDataWait); batch = reader->next(); }
//     ...
//     metrics.log_step({.step = step, .loss = loss, .lr = lr, .tokens = B * T, .samples = B});
//   }
//
// Only the main rank (rank 0) writes files and prints; other ranks compute the same figures.
// Thread safety: one thread (the training loop) uses a logger. Errors: failing to open or
// write metrics.jsonl is IoError; goodput.json as in goodput.h.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>

#include "loom/log.h"
#include "loom/metrics/flops.h"
#include "loom/metrics/goodput.h"
#include "loom/metrics/memory.h"
#include "loom/metrics/step_timer.h"
#include "loom/visibility.h"

namespace loom {
class Runtime;
}

namespace loom::metrics {

struct MetricsOptions {
  double flops_per_token = 0;  // the model's training FLOPs per token; 0 = no MFU (mfu is null)
  PeakFlops peak;              // per device; flops_per_second 0 = no MFU
  int64_t log_every = 10;      // a log line every this many steps (when stderr is not a TTY)
  double smoothing = 0.9;      // EMA weight of the past for the smoothed throughput, in [0, 1)
  // Live progress: a redrawn line when stderr is a terminal (std::nullopt = detect), else a
  // log line every log_every steps. false = log lines only.
  std::optional<bool> tty;
  bool write_jsonl = true;  // append metrics.jsonl (main rank only)
  GoodputOptions goodput;   // persist is forced off on ranks other than 0
};

// What the trainer reports after each step. Counts are this rank's.
struct StepRecord {
  int64_t step = 0;  // 0-based index of the step just finished
  int64_t epoch = 0;
  double loss = 0;
  double lr = 0;
  std::optional<double> grad_norm;  // before clipping; absent when not computed
  int64_t tokens = 0;   // tokens this rank trained on in the step (0 for non-token models)
  int64_t samples = 0;  // samples (sequences, images) this rank trained on
  // The step's phase times; absent = the logger's own timer() (begin_step must have run).
  std::optional<StepTimes> times;
};

// What log_step computed and wrote.
struct StepMetrics {
  StepRecord record;
  StepTimes times;
  double tokens_per_second = 0;  // this rank, this step
  double samples_per_second = 0;
  double tokens_per_second_smoothed = 0;  // EMA over steps
  double samples_per_second_smoothed = 0;
  std::optional<double> mfu;           // tokens/s * flops_per_token / peak (absent without both)
  std::optional<double> mfu_smoothed;  // the same from the smoothed tokens/s
  GoodputReport goodput;
  MemoryUsage memory;
};

class LOOM_API MetricsLogger {
 public:
  // Files go to rt.run_dir(), lines to rt.log(); only rank 0 writes files and prints. Every
  // step is also reported to rt (Runtime::report_step: the coordinator's job-wide metrics
  // under `loom run`), which must outlive the logger.
  MetricsLogger(const Runtime& rt, MetricsOptions options);
  // The same with everything explicit (tests, tools).
  MetricsLogger(const std::filesystem::path& run_dir, bool main_rank, spdlog::logger& log,
                MetricsOptions options);
  ~MetricsLogger();
  MetricsLogger(const MetricsLogger&) = delete;
  MetricsLogger& operator=(const MetricsLogger&) = delete;

  // The step timer log_step reads when a StepRecord has no times.
  StepTimer& timer() { return timer_; }

  // Records one finished step: computes, appends to metrics.jsonl, updates the progress line,
  // and tells the goodput account (the step's time minus its checkpoint stall is productive).
  StepMetrics log_step(const StepRecord& record);
  // Forwarded to the goodput account (goodput.h).
  void on_resume(int64_t step);
  void on_checkpoint_committed(int64_t step);
  // Clears the progress line so that other output starts on a clean line; log_step redraws.
  void clear_progress_line();

  const GoodputTracker& goodput() const { return goodput_; }
  // The JSON object log_step writes for `m` (one line, no newline). Session: process start
  // number from the goodput account.
  static std::string to_json(const StepMetrics& m, const PeakFlops& peak, int64_t session);
  // The progress line shown for `m`.
  static std::string progress_line(const StepMetrics& m);

 private:
  // Constant after construction.
  MetricsOptions options_;
  bool main_rank_;
  spdlog::logger& log_;
  bool tty_;
  std::filesystem::path jsonl_path_;
  const Runtime* runtime_ = nullptr;  // reported to, when constructed from one

  // Training-thread state.
  StepTimer timer_;
  GoodputTracker goodput_;
  std::FILE* jsonl_ = nullptr;
  double tokens_ema_ = 0;
  double samples_ema_ = 0;
  double ema_weight_ = 0;  // 1 - smoothing^n, to debias the EMA's start
  bool line_open_ = false;
  std::chrono::steady_clock::time_point last_redraw_;
};

}  // namespace loom::metrics
