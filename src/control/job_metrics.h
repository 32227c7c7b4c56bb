// The coordinator's job-wide view of training: every worker's step reports (carried by its
// heartbeats, control/heartbeat.h) kept as a bounded time series per rank across generations,
// the job's aggregates, straggler detection, and the two renderings the coordinator serves
// over HTTP: the Prometheus text format (/metrics) and JSON (/api/metrics, for `loom top`).
// docs/observability.md. Private to Loom.
//
// Not thread-safe: the coordinator calls it under its mutex.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "control/membership.h"

namespace loom::control {

// One report: the means of a rank's steps since its previous heartbeat.
struct StepPoint {
  double unix_time = 0;  // when the coordinator received it
  int64_t generation = 0;
  int64_t steps = 0;      // steps it covers
  int64_t last_step = 0;  // 0-based index of the newest
  double step_seconds = 0;
  std::map<std::string, double> phase_seconds;  // metrics::Phase names
  double tokens_per_second = 0;
  double samples_per_second = 0;
  double mfu = -1;  // < 0: unknown
  int64_t rss_bytes = 0;
  double loss = 0;
  double goodput = 0;

  // The step's time outside waits on other ranks (comm_wait): under synchronous training
  // every rank's step takes the same wall time, and a slow rank shows as the others waiting.
  double busy_seconds() const;
  // A report from the network: at least one step, finite non-negative figures (mfu may be
  // negative: unknown), at most 16 phases named [a-z_]{1,64} (they become label values).
  // InvalidArgument naming the field otherwise.
  void check() const;
};

struct JobMetricsOptions {
  size_t history = 3600;  // points kept per rank (an hour of 1 Hz heartbeats)
  // A rank is a straggler while the median of its newest `straggler_window` reports' busy
  // time exceeds `straggler_threshold` times the median of the other ranks' medians.
  double straggler_threshold = 1.3;
  size_t straggler_window = 10;
  // The hang watchdog: the job is hung when no rank has finished a step for hang_factor times
  // the median step time, and at least hang_min_seconds. hang_factor 0 turns it off.
  double hang_factor = 10;
  double hang_min_seconds = 60;
};

// What a worker's heartbeat says it is doing now.
struct RankActivity {
  int64_t step = 0;        // its newest finished step (0-based), as it reported progress
  std::string phase;       // metrics::current_activity(): "data_wait", "between_steps", ...
  std::string collective;  // the oldest collective in flight, described; "" when none

  // From the network: a phase of at most 64 bytes, a collective of at most 512.
  // InvalidArgument naming the field otherwise.
  void check() const;
};

// The job's figures from each rank's newest report in the current generation: what the
// loom_job_* gauges and /api/metrics' "summary" say.
struct JobSummary {
  int ranks = 0;  // ranks with a report in the generation; 0: none yet (the rest is empty)
  double tokens_per_second = 0;   // summed over ranks
  double samples_per_second = 0;  // summed over ranks
  double step_seconds = 0;        // the median over ranks
  std::optional<double> mfu;      // the mean of the ranks' known MFU
  std::optional<double> goodput;  // rank 0's (it keeps the job's goodput account)
  std::optional<double> loss;     // rank 0's: the mean over ranks
};

struct Straggler {
  int rank = 0;
  double busy_seconds = 0;    // its median over the window
  double others_seconds = 0;  // the other ranks' median of theirs
  double ratio = 0;           // busy / others
  std::string phase;          // the phase with the largest excess over the others' median
  double phase_excess_seconds = 0;
};

class JobMetrics {
 public:
  explicit JobMetrics(JobMetricsOptions options = {});

  // Adds rank's report. The newest generation seen is the current one: detection and the
  // per-rank gauges look at its reports only.
  void record(int rank, StepPoint point);
  // A worker heartbeat of `generation` at unix time `now`: what the rank does, and whether the
  // job progresses (a step newer than any seen in the generation).
  void observe(int rank, int64_t generation, RankActivity activity, double now);
  // The watchdog at unix time `now`. A hang starting or ending is an event; returns true when
  // one started at this call (the coordinator then has every rank dump its flight recorder).
  bool check_hang(double now);
  // The description of the hang in progress ("" when none): each rank's step, phase and
  // collective, and the ranks outside collectives.
  const std::string& hang() const { return hang_; }
  // What to log since the last call: a rank flagged as a straggler or a hang (warnings), a
  // rank no longer one, the flags cleared by a new generation, or progress after a hang
  // (information).
  struct Event {
    bool warning = false;
    std::string text;
    bool operator==(const Event& o) const { return warning == o.warning && text == o.text; }
  };
  std::vector<Event> take_events();

  const std::vector<Straggler>& stragglers() const { return stragglers_; }
  int64_t generation() const { return generation_; }
  const std::map<int, std::deque<StepPoint>>& series() const { return series_; }

  JobSummary summary() const;
  // The Prometheus text exposition format (version 0.0.4) of the job and its ranks.
  std::string prometheus(const MembershipStatus& status) const;
  // The same as one JSON object, with each rank's series: {"job": {...}, "summary": {...},
  // "ranks": [...], "stragglers": [...], "generations": [{generation, start_unix_time}]}.
  std::string json(const MembershipStatus& status) const;

 private:
  void detect();
  void start_generation(int64_t generation);
  // The newest point of each rank in the current generation.
  std::map<int, const StepPoint*> latest() const;

  JobMetricsOptions options_;
  int64_t generation_ = -1;
  std::map<int, std::deque<StepPoint>> series_;
  std::map<int64_t, double> generation_start_;  // generation -> its first report's time
  std::map<int, RankActivity> activity_;        // the current generation's ranks
  int64_t progress_step_ = -1;                  // the newest step any rank finished
  double progress_time_ = 0;                    // when it was first seen
  std::string hang_;
  std::vector<Straggler> stragglers_;
  std::vector<Event> events_;
};

}  // namespace loom::control
