// Per-step metrics: throughput, MFU, goodput, memory; metrics.jsonl and the progress line.
#include "loom/metrics/logger.h"

#include <unistd.h>

#include <nlohmann/json.hpp>

#include <cerrno>
#include <chrono>
#include <cmath>

#include "loom/error.h"
#include "loom/runtime.h"

namespace loom::metrics {
namespace {

GoodputOptions goodput_options(GoodputOptions options, bool main_rank) {
  if (!main_rank) options.persist = false;
  return options;
}

std::string human(double value, const char* unit) {
  const char* prefixes[] = {"", "k", "M", "G", "T"};
  int i = 0;
  while (std::fabs(value) >= 1000 && i < 4) {
    value /= 1000;
    ++i;
  }
  return fmt::format("{:.{}f}{}{}", value, value < 10 ? 2 : (value < 100 ? 1 : 0), prefixes[i],
                     unit);
}

nlohmann::json optional_number(const std::optional<double>& v) {
  return v ? nlohmann::json(*v) : nlohmann::json(nullptr);
}

}  // namespace

MetricsLogger::MetricsLogger(const Runtime& rt, MetricsOptions options)
    : MetricsLogger(rt.run_dir(), rt.is_main(), rt.log(), std::move(options)) {
  runtime_ = &rt;
}

MetricsLogger::MetricsLogger(const std::filesystem::path& run_dir, bool main_rank,
                             spdlog::logger& log, MetricsOptions options)
    : options_(std::move(options)),
      main_rank_(main_rank),
      log_(log),
      tty_(main_rank && options_.tty.value_or(::isatty(STDERR_FILENO) == 1)),
      jsonl_path_(run_dir / "metrics.jsonl"),
      goodput_(run_dir, goodput_options(options_.goodput, main_rank)) {
  LOOM_CHECK(options_.smoothing >= 0 && options_.smoothing < 1, InvalidArgument,
             "MetricsOptions::smoothing must be in [0, 1), got ", options_.smoothing);
  LOOM_CHECK(options_.log_every > 0, InvalidArgument,
             "MetricsOptions::log_every must be positive, got ", options_.log_every);
  if (main_rank_ && options_.write_jsonl) {
    jsonl_ = std::fopen(jsonl_path_.c_str(), "a");
    if (jsonl_ == nullptr) {
      detail::throw_system_error(errno, "fopen", "opening " + jsonl_path_.string(), __FILE__,
                                 __LINE__);
    }
  }
}

MetricsLogger::~MetricsLogger() {
  if (line_open_) std::fputs("\n", stderr);
  if (jsonl_ != nullptr) std::fclose(jsonl_);
}

void MetricsLogger::on_resume(int64_t step) { goodput_.on_resume(step); }

void MetricsLogger::on_checkpoint_committed(int64_t step) {
  goodput_.on_checkpoint_committed(step);
}

void MetricsLogger::clear_progress_line() {
  if (!line_open_) return;
  std::fputs("\r\x1b[K", stderr);
  std::fflush(stderr);
  line_open_ = false;
}

StepMetrics MetricsLogger::log_step(const StepRecord& record) {
  StepMetrics m;
  m.record = record;
  m.times = record.times ? *record.times : timer_.end_step();
  const double seconds = std::max(m.times.total, 1e-12);
  m.tokens_per_second = static_cast<double>(record.tokens) / seconds;
  m.samples_per_second = static_cast<double>(record.samples) / seconds;
  // Exponential moving average, debiased so that the first steps are not pulled towards 0.
  const double a = options_.smoothing;
  tokens_ema_ = a * tokens_ema_ + (1 - a) * m.tokens_per_second;
  samples_ema_ = a * samples_ema_ + (1 - a) * m.samples_per_second;
  ema_weight_ = a * ema_weight_ + (1 - a);
  m.tokens_per_second_smoothed = tokens_ema_ / ema_weight_;
  m.samples_per_second_smoothed = samples_ema_ / ema_weight_;
  if (options_.flops_per_token > 0 && options_.peak.flops_per_second > 0) {
    const double per_token = options_.flops_per_token / options_.peak.flops_per_second;
    m.mfu = m.tokens_per_second * per_token;
    m.mfu_smoothed = m.tokens_per_second_smoothed * per_token;
  }
  goodput_.on_step(record.step, std::max(0.0, m.times.total - m.times[Phase::kCheckpointStall]));
  m.goodput = goodput_.report();
  m.memory = process_memory();
  if (runtime_ != nullptr) runtime_->report_step(m);

  if (!main_rank_) return m;
  if (jsonl_ != nullptr) {
    const std::string line = to_json(m, options_.peak, m.goodput.sessions) + "\n";
    if (std::fwrite(line.data(), 1, line.size(), jsonl_) != line.size() ||
        std::fflush(jsonl_) != 0) {
      detail::throw_system_error(errno, "fwrite", "appending to " + jsonl_path_.string(), __FILE__,
                                 __LINE__);
    }
  }
  const bool log_line = (record.step + 1) % options_.log_every == 0;
  if (tty_) {
    if (log_line) {
      clear_progress_line();
      log_.info("{}", progress_line(m));
    }
    // Redraw at most 10 times a second: tiny models run thousands of steps a second.
    const auto now = std::chrono::steady_clock::now();
    if (log_line || !line_open_ || now - last_redraw_ >= std::chrono::milliseconds(100)) {
      std::fprintf(stderr, "\r\x1b[K%s", progress_line(m).c_str());
      std::fflush(stderr);
      line_open_ = true;
      last_redraw_ = now;
    }
  } else if (log_line) {
    log_.info("{}", progress_line(m));
  }
  return m;
}

std::string MetricsLogger::to_json(const StepMetrics& m, const PeakFlops& peak, int64_t session) {
  nlohmann::json phases = nlohmann::json::object();
  for (size_t i = 0; i < kNumPhases; ++i) {
    phases[to_string(static_cast<Phase>(i))] = m.times.seconds[i];
  }
  const double unix_time =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  const nlohmann::json j = {
      {"step", m.record.step},
      {"epoch", m.record.epoch},
      {"session", session},
      {"time", unix_time},
      {"loss", m.record.loss},
      {"lr", m.record.lr},
      {"grad_norm", optional_number(m.record.grad_norm)},
      {"tokens", m.record.tokens},
      {"samples", m.record.samples},
      {"step_seconds", m.times.total},
      {"tokens_per_s", m.tokens_per_second},
      {"samples_per_s", m.samples_per_second},
      {"tokens_per_s_smoothed", m.tokens_per_second_smoothed},
      {"samples_per_s_smoothed", m.samples_per_second_smoothed},
      {"mfu", optional_number(m.mfu)},
      {"mfu_smoothed", optional_number(m.mfu_smoothed)},
      {"peak_flops", peak.flops_per_second},
      {"peak_source", peak.source},
      {"phases", phases},
      {"rss_bytes", m.memory.rss_bytes},
      {"peak_rss_bytes", m.memory.peak_rss_bytes},
      {"goodput", m.goodput.goodput},
      {"productive_seconds", m.goodput.productive_seconds},
      {"lost_seconds", m.goodput.lost_seconds},
      {"wall_seconds", m.goodput.wall_seconds},
  };
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string MetricsLogger::progress_line(const StepMetrics& m) {
  const StepRecord& r = m.record;
  std::string line =
      fmt::format("step {} | epoch {} | loss {:.4f} | lr {:.2e}", r.step, r.epoch, r.loss, r.lr);
  if (r.grad_norm) line += fmt::format(" | gnorm {:.2f}", *r.grad_norm);
  if (r.tokens > 0) {
    line += " | " + human(m.tokens_per_second_smoothed, " tok/s");
  } else {
    line += " | " + human(m.samples_per_second_smoothed, " samples/s");
  }
  if (m.mfu_smoothed) line += fmt::format(" | MFU {:.1f}%", 100 * *m.mfu_smoothed);
  const double total = std::max(m.times.total, 1e-12);
  line += fmt::format(
      " | data {:.0f}% fwd/bwd {:.0f}% opt {:.0f}%", 100 * m.times[Phase::kDataWait] / total,
      100 * m.times[Phase::kForwardBackward] / total, 100 * m.times[Phase::kOptimizer] / total);
  if (m.times[Phase::kCommWait] > 0) {
    line += fmt::format(" comm {:.0f}%", 100 * m.times[Phase::kCommWait] / total);
  }
  if (m.times[Phase::kCheckpointStall] > 0) {
    line += fmt::format(" ckpt {:.0f}%", 100 * m.times[Phase::kCheckpointStall] / total);
  }
  line += fmt::format(" | rss {:.2f} GiB | goodput {:.1f}%",
                      static_cast<double>(m.memory.rss_bytes) / (1 << 30), 100 * m.goodput.goodput);
  return line;
}

}  // namespace loom::metrics
