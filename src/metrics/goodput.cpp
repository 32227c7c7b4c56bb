// The job-wide goodput account, persisted in <run_dir>/goodput.json (see goodput.h).
#include "loom/metrics/goodput.h"

#include <nlohmann/json.hpp>

#include <algorithm>

#include "loom/error.h"
#include "util/files.h"
#include "util/json.h"

namespace loom::metrics {
namespace {

constexpr int kFormatVersion = 1;

double committed_of(const std::vector<std::pair<int64_t, double>>& commits) {
  return commits.empty() ? 0.0 : commits.back().second;
}

}  // namespace

GoodputTracker::GoodputTracker(const std::filesystem::path& run_dir, GoodputOptions options)
    : file_(run_dir / "goodput.json"), options_(std::move(options)) {
  session_start_ = now();
  last_flush_ = session_start_;
  if (options_.persist && std::filesystem::exists(file_)) {
    try {
      const nlohmann::json j = nlohmann::json::parse(util::read_file(file_));
      LOOM_CHECK(j.at("format") == "loom-goodput" && j.at("version") == kFormatVersion, CorruptData,
                 "not a version ", kFormatVersion, " goodput account");
      previous_wall_ = j.at("wall_seconds").get<double>();
      sessions_ = util::integer_field<int64_t>(j.at("sessions"), "sessions", "");
      lost_ = j.at("lost_seconds").get<double>();
      for (const auto& c : j.at("commits")) {
        commits_.emplace_back(util::integer_field<int64_t>(c.at(0), "commits[][0]", ""),
                              c.at(1).get<double>());
      }
      const auto& p = j.at("pending");
      previous_pending_ = {p.at("seconds").get<double>(),
                           util::integer_field<int64_t>(p.at("first_step"), "first_step", ""),
                           util::integer_field<int64_t>(p.at("last_step"), "last_step", "")};
    } catch (const nlohmann::json::exception& e) {
      throw CorruptData(detail::concat(file_.string(), " is not a goodput account (", e.what(),
                                       "); delete it to start a new one"));
    } catch (const CorruptData& e) {
      throw CorruptData(
          detail::concat(file_.string(), ": ", e.what(), "; delete it to start a new one"));
    }
  }
  ++sessions_;
}

GoodputTracker::~GoodputTracker() {
  try {
    flush();
  } catch (...) {
    // Losing the last few seconds of the account is better than terminating.
  }
}

GoodputTracker::TimePoint GoodputTracker::now() const {
  return options_.clock ? options_.clock() : std::chrono::steady_clock::now();
}

void GoodputTracker::resolve_previous(int64_t resume_step) {
  LOOM_CHECK(resume_step >= 0, InvalidArgument, "goodput: resume step must be >= 0, got ",
             resume_step);
  resolved_ = true;
  // Commits beyond the resume point belong to steps that will be re-done.
  double kept = 0;
  size_t keep = 0;
  while (keep < commits_.size() && commits_[keep].first <= resume_step) {
    kept = commits_[keep].second;
    ++keep;
  }
  lost_ += committed_of(commits_) - kept;
  commits_.resize(keep);
  // Pending steps of earlier processes survive only below the resume step; if a commit at
  // resume_step was never recorded, prorate them by step count.
  Pending& p = previous_pending_;
  if (p.last_step >= p.first_step) {
    const int64_t steps = p.last_step - p.first_step + 1;
    const int64_t surviving = std::clamp<int64_t>(resume_step - p.first_step, 0, steps);
    const double survived = p.seconds * static_cast<double>(surviving) / static_cast<double>(steps);
    lost_ += p.seconds - survived;
    if (survived > 0) commits_.emplace_back(resume_step, committed_of(commits_) + survived);
  }
  p = Pending{};
  // Steps of this process at or after the resume point are re-done too.
  while (!pending_.empty() && pending_.back().first >= resume_step) {
    lost_ += pending_.back().second;
    pending_seconds_ -= pending_.back().second;
    pending_.pop_back();
  }
  last_step_ = std::min(last_step_, resume_step - 1);
}

void GoodputTracker::on_resume(int64_t step) {
  resolve_previous(step);
  flush();
}

void GoodputTracker::on_step(int64_t step, double productive_seconds) {
  if (!resolved_) resolve_previous(step);
  LOOM_CHECK(step > last_step_, InvalidArgument, "goodput: step ", step, " reported after step ",
             last_step_, " (steps must increase; call on_resume first)");
  LOOM_CHECK(productive_seconds >= 0, InvalidArgument, "goodput: step ", step,
             " has negative time ", productive_seconds);
  last_step_ = step;
  pending_.emplace_back(step, productive_seconds);
  pending_seconds_ += productive_seconds;
  maybe_flush();
}

void GoodputTracker::on_checkpoint_committed(int64_t step) {
  if (!resolved_) resolve_previous(step);
  double committed = committed_of(commits_);
  while (!pending_.empty() && pending_.front().first < step) {
    committed += pending_.front().second;
    pending_seconds_ -= pending_.front().second;
    pending_.pop_front();
  }
  if (!commits_.empty() && commits_.back().first >= step) {
    // A commit at or before a known one adds nothing new (its steps were counted already).
    commits_.back().second = committed;
  } else {
    commits_.emplace_back(step, committed);
  }
  if (pending_.empty()) pending_seconds_ = 0;  // no drift from repeated subtraction
  flush();
}

GoodputReport GoodputTracker::report() const {
  GoodputReport r;
  r.wall_seconds = previous_wall_ + std::chrono::duration<double>(now() - session_start_).count();
  r.productive_seconds =
      committed_of(commits_) + pending_seconds_ + (resolved_ ? 0.0 : previous_pending_.seconds);
  r.lost_seconds = lost_;
  r.goodput = r.wall_seconds > 0 ? r.productive_seconds / r.wall_seconds : 0.0;
  r.sessions = sessions_;
  return r;
}

void GoodputTracker::maybe_flush() {
  if (now() - last_flush_ >= options_.flush_interval) flush();
}

void GoodputTracker::flush() {
  last_flush_ = now();
  if (!options_.persist) return;
  Pending p = resolved_ ? Pending{} : previous_pending_;
  if (!pending_.empty()) {
    const bool had = p.last_step >= p.first_step;
    p.first_step = had ? std::min(p.first_step, pending_.front().first) : pending_.front().first;
    p.last_step = std::max(p.last_step, pending_.back().first);
    p.seconds += pending_seconds_;
  }
  const GoodputReport r = report();
  nlohmann::json commits = nlohmann::json::array();
  for (const auto& [step, seconds] : commits_) commits.push_back({step, seconds});
  const nlohmann::json j = {
      {"format", "loom-goodput"},
      {"version", kFormatVersion},
      {"sessions", sessions_},
      {"wall_seconds", r.wall_seconds},
      {"productive_seconds", r.productive_seconds},
      {"lost_seconds", lost_},
      {"goodput", r.goodput},
      {"commits", commits},
      {"pending",
       {{"seconds", p.seconds}, {"first_step", p.first_step}, {"last_step", p.last_step}}},
  };
  util::write_file_atomic(file_, j.dump(1) + "\n");
}

}  // namespace loom::metrics
