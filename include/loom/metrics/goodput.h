// metrics::GoodputTracker: the share of a job's wall time that produced training progress
// which survives, over the whole job, restarts included. It persists in
// <run_dir>/goodput.json, so every process start adds to the same account.
//
// Definitions (docs/metrics.md):
//   wall time       the sum over every process of the job of the time from the tracker's
//                   construction to its last flush: start-up, evaluation, checkpoints, all;
//   productive time the summed time of training steps whose results survive, as reported by
//                   on_step (the trainer passes the step's time minus its checkpoint stall);
//   lost time       the time of steps that were re-done: after a restart from a checkpoint
//                   taken after `s` steps, every step numbered s or later that earlier
//                   processes ran is lost;
//   goodput         productive / wall.
// Step numbers count from 0: on_step(s) reports step s; a checkpoint committed "at s" holds
// the results of steps 0 .. s-1, and resuming "at s" runs step s next.
//
// Steps not yet covered by a committed checkpoint are kept apart (pending): a restart that
// resumes before them loses them; if the job ends without a restart they are productive. The
// tracker remembers every commit, so resuming from an older checkpoint is exact too. If a
// process died between a commit and the flush that records it, the new process's resume step
// is beyond the last known commit; the pending time of the steps before it is then prorated
// by step count (their individual times are not persisted).
//
// Persistence: goodput.json is rewritten atomically (temp file, fsync, rename) at every
// on_resume and on_checkpoint_committed, on_step at most every flush_interval, and at
// destruction. A process killed without a flush loses at most flush_interval of wall time
// from the account (so goodput is then slightly overstated).
//
// Thread safety: one thread uses a tracker. Errors: an unreadable goodput.json is CorruptData
// naming it (delete it to start a new account); failed writes are IoError.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <filesystem>
#include <functional>
#include <utility>
#include <vector>

#include "loom/visibility.h"

namespace loom::metrics {

struct GoodputOptions {
  // Write goodput.json (rank 0 does; other ranks keep an in-memory account).
  bool persist = true;
  // Longest time between two writes caused by on_step.
  std::chrono::duration<double> flush_interval = std::chrono::seconds(10);
  // For tests; the default is std::chrono::steady_clock::now.
  std::function<std::chrono::steady_clock::time_point()> clock;
};

struct GoodputReport {
  double wall_seconds = 0;        // every process of the job, this one up to now
  double productive_seconds = 0;  // committed + pending steps that survive so far
  double lost_seconds = 0;        // steps that were re-done
  double goodput = 0;             // productive / wall (0 when wall is 0)
  int64_t sessions = 0;           // process starts, this one included
};

class LOOM_API GoodputTracker {
 public:
  // Reads <run_dir>/goodput.json when it exists and starts a new session (process start).
  explicit GoodputTracker(const std::filesystem::path& run_dir, GoodputOptions options = {});
  // Flushes; errors are swallowed (a destructor must not throw).
  ~GoodputTracker();
  GoodputTracker(const GoodputTracker&) = delete;
  GoodputTracker& operator=(const GoodputTracker&) = delete;

  // This process continues the job after `step` steps (0 for a fresh start), i.e. from a
  // checkpoint committed at `step`. Steps numbered `step` or later that earlier processes ran
  // become lost. Without a call, the first on_step(s) implies on_resume(s).
  void on_resume(int64_t step);
  // Step `step` finished; `productive_seconds` is its time (steps must increase).
  void on_step(int64_t step, double productive_seconds);
  // A checkpoint holding steps 0 .. step-1 is durable: their time is committed.
  void on_checkpoint_committed(int64_t step);

  GoodputReport report() const;
  void flush();
  const std::filesystem::path& file() const { return file_; }

 private:
  using TimePoint = std::chrono::steady_clock::time_point;
  struct Pending {  // steps of earlier processes not covered by a commit
    double seconds = 0;
    int64_t first_step = 0;
    int64_t last_step = -1;  // empty when last_step < first_step
  };
  TimePoint now() const;
  void resolve_previous(int64_t resume_step);
  void maybe_flush();

  // Constant after construction.
  std::filesystem::path file_;
  GoodputOptions options_;
  TimePoint session_start_;

  // The account (this thread only).
  double previous_wall_ = 0;  // earlier processes
  int64_t sessions_ = 0;
  double lost_ = 0;
  std::vector<std::pair<int64_t, double>> commits_;  // (step, committed seconds), increasing
  Pending previous_pending_;
  bool resolved_ = false;                           // on_resume (explicit or implied) ran
  std::deque<std::pair<int64_t, double>> pending_;  // this process: (step, seconds)
  double pending_seconds_ = 0;                      // the sum over pending_
  int64_t last_step_ = -1;
  TimePoint last_flush_;
};

}  // namespace loom::metrics
