// The coordinator's job-wide metrics: bounded series per rank, stragglers, Prometheus and
// JSON renderings.
#include "control/job_metrics.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <set>

#include "loom/error.h"

namespace loom::control {
namespace {

const char* const kCommWait = "comm_wait";

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  const size_t mid = v.size() / 2;
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(mid), v.end());
  const double upper = v[mid];
  if (v.size() % 2 == 1) return upper;
  return (*std::max_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(mid)) + upper) / 2;
}

// A sample value as Prometheus writes them (Go's float syntax).
std::string number(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  return fmt::format("{}", v);
}

// One metric family of the text format: HELP, TYPE, then its samples.
class Family {
 public:
  Family(std::string& out, const char* name, const char* type, const char* help)
      : out_(out), name_(name) {
    out_ += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
  }
  void add(double value, const std::string& labels = "") {
    out_ += name_;
    if (!labels.empty()) out_ += "{" + labels + "}";
    out_ += " " + number(value) + "\n";
  }

 private:
  std::string& out_;
  const char* name_;
};

std::string rank_label(int rank) { return fmt::format("rank=\"{}\"", rank); }

nlohmann::json point_json(const StepPoint& p) {
  return {{"unix_time", p.unix_time},
          {"generation", p.generation},
          {"steps", p.steps},
          {"last_step", p.last_step},
          {"step_seconds", p.step_seconds},
          {"busy_seconds", p.busy_seconds()},
          {"phase_seconds", p.phase_seconds},
          {"tokens_per_second", p.tokens_per_second},
          {"samples_per_second", p.samples_per_second},
          {"mfu", p.mfu < 0 ? nlohmann::json(nullptr) : nlohmann::json(p.mfu)},
          {"rss_bytes", p.rss_bytes},
          {"loss", p.loss},
          {"goodput", p.goodput}};
}

}  // namespace

double StepPoint::busy_seconds() const {
  const auto wait = phase_seconds.find(kCommWait);
  return std::max(0.0, step_seconds - (wait == phase_seconds.end() ? 0.0 : wait->second));
}

void StepPoint::check() const {
  LOOM_CHECK(steps >= 1 && last_step >= 0, InvalidArgument,
             "a step report needs steps >= 1 and last_step >= 0, got ", steps, " and ", last_step);
  const auto figure = [](const char* name, double v) {
    LOOM_CHECK(std::isfinite(v) && v >= 0, InvalidArgument, "step report field ", name,
               " must be finite and >= 0, got ", v);
  };
  figure("step_seconds", step_seconds);
  figure("tokens_per_second", tokens_per_second);
  figure("samples_per_second", samples_per_second);
  figure("rss_bytes", static_cast<double>(rss_bytes));
  figure("goodput", goodput);
  LOOM_CHECK(std::isfinite(mfu), InvalidArgument, "step report field mfu must be finite, got ",
             mfu);
  // The loss may be anything: a diverged run's is NaN, and the metrics should show it.
  LOOM_CHECK(phase_seconds.size() <= 16, InvalidArgument,
             "a step report has at most 16 phases, got ", phase_seconds.size());
  for (const auto& [name, seconds] : phase_seconds) {
    const bool plain = !name.empty() && name.size() <= 64 &&
                       std::all_of(name.begin(), name.end(),
                                   [](char c) { return (c >= 'a' && c <= 'z') || c == '_'; });
    LOOM_CHECK(plain, InvalidArgument, "step report phase names are [a-z_]{1,64}, got '",
               name.substr(0, 64), "'");
    figure(("phase_seconds[" + name + "]").c_str(), seconds);
  }
}

void RankActivity::check() const {
  LOOM_CHECK(phase.size() <= 64, InvalidArgument, "a heartbeat's phase is at most 64 bytes, got ",
             phase.size());
  LOOM_CHECK(collective.size() <= 512, InvalidArgument,
             "a heartbeat's collective is at most 512 bytes, got ", collective.size());
}

JobMetrics::JobMetrics(JobMetricsOptions options) : options_(options) {
  LOOM_CHECK(options_.history >= 1, InvalidArgument, "JobMetricsOptions::history must be >= 1");
  LOOM_CHECK(options_.straggler_window >= 1 && options_.straggler_window <= options_.history,
             InvalidArgument, "the straggler window must be in [1, history = ", options_.history,
             "] reports, got ", options_.straggler_window);
  LOOM_CHECK(options_.hang_factor >= 0 && options_.hang_min_seconds >= 0, InvalidArgument,
             "the hang watchdog's factor and minimum must be >= 0 (factor 0: off), got ",
             options_.hang_factor, " and ", options_.hang_min_seconds);
  LOOM_CHECK(options_.straggler_threshold > 1, InvalidArgument,
             "the straggler threshold is a ratio above 1 (1.3: 30% slower than the others' "
             "median), got ",
             options_.straggler_threshold);
}

void JobMetrics::start_generation(int64_t generation) {
  generation_ = generation;
  if (!stragglers_.empty())
    events_.push_back({false, fmt::format("generation {}: straggler flags cleared", generation_)});
  stragglers_.clear();
  activity_.clear();
  progress_step_ = -1;
  hang_.clear();
}

void JobMetrics::observe(int rank, int64_t generation, RankActivity activity, double now) {
  if (generation < generation_) return;
  if (generation > generation_) start_generation(generation);
  if (progress_step_ < 0 || activity.step > progress_step_) {
    progress_step_ = activity.step;
    progress_time_ = now;
    if (!hang_.empty()) {
      events_.push_back(
          {false, fmt::format("the job progresses again: step {} finished", progress_step_)});
      hang_.clear();
    }
  }
  activity_[rank] = std::move(activity);
}

bool JobMetrics::check_hang(double now) {
  if (options_.hang_factor <= 0 || progress_step_ < 0 || !hang_.empty()) return false;
  const JobSummary job = summary();
  if (job.ranks == 0) return false;  // no step time to scale yet
  const double median_step = job.step_seconds;
  const double threshold = std::max(options_.hang_min_seconds, options_.hang_factor * median_step);
  const double stalled = now - progress_time_;
  if (stalled < threshold) return false;
  std::string ranks, outside;
  for (const auto& [rank, a] : activity_) {
    const std::string phase = a.phase.empty() ? "phase unknown" : a.phase;
    ranks += fmt::format("; rank {}: step {}, {}, {}", rank, a.step, phase,
                         a.collective.empty() ? "in no collective" : "waiting in " + a.collective);
    if (a.collective.empty())
      outside += fmt::format("{}rank {} ({})", outside.empty() ? "" : ", ", rank, phase);
  }
  hang_ = fmt::format(
      "no rank has finished a step for {:.1f} s (threshold {:.1f} s: {}x the median step time "
      "{:.3f} s, at least {} s){}. Outside collectives: {}",
      stalled, threshold, options_.hang_factor, median_step, options_.hang_min_seconds, ranks,
      outside.empty() ? "none (every rank waits in a collective: compare the flight dumps)"
                      : outside);
  events_.push_back({true, "hang: " + hang_});
  return true;
}

void JobMetrics::record(int rank, StepPoint point) {
  if (point.generation < generation_) return;  // a late report of an ended generation
  if (point.generation > generation_) start_generation(point.generation);
  generation_start_.emplace(point.generation, point.unix_time);
  std::deque<StepPoint>& series = series_[rank];
  series.push_back(std::move(point));
  while (series.size() > options_.history) series.pop_front();
  // Generations whose every point aged out are forgotten too.
  double oldest = series.front().unix_time;
  for (const auto& [r, s] : series_) oldest = std::min(oldest, s.front().unix_time);
  while (generation_start_.size() > 1 && std::next(generation_start_.begin())->second <= oldest)
    generation_start_.erase(generation_start_.begin());
  detect();
}

std::vector<JobMetrics::Event> JobMetrics::take_events() { return std::exchange(events_, {}); }

std::map<int, const StepPoint*> JobMetrics::latest() const {
  std::map<int, const StepPoint*> out;
  for (const auto& [rank, series] : series_) {
    if (series.back().generation == generation_) out[rank] = &series.back();
  }
  return out;
}

void JobMetrics::detect() {
  // Each rank's medians over its window, for ranks with a full window in this generation.
  struct Window {
    double busy = 0;
    std::map<std::string, double> phases;
  };
  std::map<int, Window> windows;
  for (const auto& [rank, series] : series_) {
    if (series.size() < options_.straggler_window) continue;
    const auto first = series.end() - static_cast<std::ptrdiff_t>(options_.straggler_window);
    if (first->generation != generation_) continue;
    std::vector<double> busy;
    std::map<std::string, std::vector<double>> phases;
    for (auto it = first; it != series.end(); ++it) {
      busy.push_back(it->busy_seconds());
      for (const auto& [phase, seconds] : it->phase_seconds) phases[phase].push_back(seconds);
    }
    Window& w = windows[rank];
    w.busy = median(busy);
    for (auto& [phase, values] : phases) w.phases[phase] = median(std::move(values));
  }
  std::vector<Straggler> found;
  if (windows.size() >= 2) {
    for (const auto& [rank, w] : windows) {
      std::vector<double> others;
      for (const auto& [o, ow] : windows)
        if (o != rank) others.push_back(ow.busy);
      const double others_median = median(others);
      if (others_median <= 0 || w.busy <= options_.straggler_threshold * others_median) continue;
      Straggler s{.rank = rank,
                  .busy_seconds = w.busy,
                  .others_seconds = others_median,
                  .ratio = w.busy / others_median};
      s.phase_excess_seconds = -1;
      for (const auto& [phase, seconds] : w.phases) {
        if (phase == kCommWait) continue;
        std::vector<double> theirs;
        for (const auto& [o, ow] : windows) {
          const auto it = ow.phases.find(phase);
          if (o != rank) theirs.push_back(it == ow.phases.end() ? 0.0 : it->second);
        }
        const double excess = seconds - median(theirs);
        if (excess > s.phase_excess_seconds) {
          s.phase = phase;
          s.phase_excess_seconds = excess;
        }
      }
      found.push_back(s);
    }
  }
  std::set<int> before, after;
  for (const Straggler& s : stragglers_) before.insert(s.rank);
  for (const Straggler& s : found) {
    after.insert(s.rank);
    if (before.count(s.rank) == 0) {
      events_.push_back({true, fmt::format("rank {} is a straggler: {:.3f} s per step outside "
                                           "collective waits against the other "
                                           "ranks' median {:.3f} s ({:.2f}x, threshold {}x) over "
                                           "its last {} reports; most of the "
                                           "difference is in {} (+{:.3f} s)",
                                           s.rank, s.busy_seconds, s.others_seconds, s.ratio,
                                           options_.straggler_threshold, options_.straggler_window,
                                           s.phase, s.phase_excess_seconds)});
    }
  }
  for (int rank : before) {
    if (after.count(rank) == 0)
      events_.push_back({false, fmt::format("rank {} is no longer a straggler", rank)});
  }
  stragglers_ = std::move(found);
}

JobSummary JobMetrics::summary() const {
  JobSummary job;
  std::vector<double> step_seconds, mfu;
  for (const auto& [rank, p] : latest()) {
    ++job.ranks;
    step_seconds.push_back(p->step_seconds);
    job.tokens_per_second += p->tokens_per_second;
    job.samples_per_second += p->samples_per_second;
    if (p->mfu >= 0) mfu.push_back(p->mfu);
    if (rank == 0) {
      job.goodput = p->goodput;
      job.loss = p->loss;
    }
  }
  job.step_seconds = median(step_seconds);
  if (!mfu.empty()) {
    double sum = 0;
    for (double m : mfu) sum += m;
    job.mfu = sum / static_cast<double>(mfu.size());
  }
  return job;
}

std::string JobMetrics::prometheus(const MembershipStatus& status) const {
  std::string out;
  Family(out, "loom_generation", "gauge",
         "The generation the job runs (a new one after every restart or membership change).")
      .add(static_cast<double>(status.generation));
  Family(out, "loom_restarts_total", "counter", "Generations ended by a failure.")
      .add(status.restarts);
  Family(out, "loom_world_size", "gauge", "Workers in the current generation.")
      .add(status.world_size);
  Family(out, "loom_job_running", "gauge", "1 while a generation runs, else 0.")
      .add(status.phase == Phase::kRunning ? 1 : 0);

  const JobSummary job = summary();
  if (job.ranks > 0) {
    Family(out, "loom_job_tokens_per_second", "gauge",
           "Tokens trained per second, summed over the ranks' newest reports.")
        .add(job.tokens_per_second);
    Family(out, "loom_job_samples_per_second", "gauge",
           "Samples trained per second, summed over the ranks' newest reports.")
        .add(job.samples_per_second);
    Family(out, "loom_job_step_seconds", "gauge",
           "The median over ranks of their newest mean step time.")
        .add(job.step_seconds);
    if (job.mfu) {
      Family(out, "loom_job_mfu_ratio", "gauge",
             "Model FLOPs utilisation, the mean of the ranks' newest.")
          .add(*job.mfu);
    }
    if (job.goodput) {
      Family(out, "loom_job_goodput_ratio", "gauge",
             "Productive time over wall time since the job started, as rank 0 accounts it.")
          .add(*job.goodput);
      Family(out, "loom_job_loss", "gauge", "The newest step's loss (the mean over ranks).")
          .add(*job.loss);
    }
  }
  Family(out, "loom_job_stragglers", "gauge", "Ranks flagged as stragglers now.")
      .add(static_cast<double>(stragglers_.size()));
  Family(out, "loom_job_hung", "gauge",
         "1 while no rank has finished a step for longer than the hang threshold, else 0.")
      .add(hang_.empty() ? 0 : 1);

  if (!status.workers.empty()) {
    Family age(out, "loom_rank_heartbeat_age_seconds", "gauge",
               "Seconds since the rank's last heartbeat.");
    for (const auto& w : status.workers) age.add(w.seconds_since_heartbeat, rank_label(w.rank));
  }
  const std::map<int, const StepPoint*> now = latest();
  if (now.empty()) return out;
  const auto per_rank = [&](const char* name, const char* help, auto value) {
    Family f(out, name, "gauge", help);
    for (const auto& [rank, p] : now) f.add(value(*p), rank_label(rank));
  };
  per_rank("loom_rank_step", "The newest step the rank finished (0-based).",
           [](const StepPoint& p) { return static_cast<double>(p.last_step); });
  per_rank("loom_rank_step_seconds", "Mean step time over the rank's newest report.",
           [](const StepPoint& p) { return p.step_seconds; });
  per_rank("loom_rank_busy_seconds",
           "Mean step time outside collective waits (comm_wait) over the newest report.",
           [](const StepPoint& p) { return p.busy_seconds(); });
  {
    Family f(out, "loom_rank_phase_seconds", "gauge",
             "Mean time per step in each phase over the rank's newest report.");
    for (const auto& [rank, p] : now) {
      for (const auto& [phase, seconds] : p->phase_seconds)
        f.add(seconds, fmt::format("rank=\"{}\",phase=\"{}\"", rank, phase));
    }
  }
  per_rank("loom_rank_tokens_per_second", "Tokens per second over the rank's newest report.",
           [](const StepPoint& p) { return p.tokens_per_second; });
  per_rank("loom_rank_samples_per_second", "Samples per second over the rank's newest report.",
           [](const StepPoint& p) { return p.samples_per_second; });
  if (job.mfu) {
    Family f(out, "loom_rank_mfu_ratio", "gauge",
             "Model FLOPs utilisation over the rank's newest report.");
    for (const auto& [rank, p] : now) {
      if (p->mfu >= 0) f.add(p->mfu, rank_label(rank));
    }
  }
  per_rank("loom_rank_resident_memory_bytes", "Resident memory of the rank's process.",
           [](const StepPoint& p) { return static_cast<double>(p.rss_bytes); });
  {
    Family f(out, "loom_rank_straggler", "gauge",
             "1 while the rank is flagged as a straggler, else 0.");
    for (const auto& [rank, p] : now) {
      const bool flagged = std::any_of(stragglers_.begin(), stragglers_.end(),
                                       [r = rank](const Straggler& s) { return s.rank == r; });
      f.add(flagged ? 1 : 0, rank_label(rank));
    }
  }
  return out;
}

std::string JobMetrics::json(const MembershipStatus& status) const {
  nlohmann::json job = {{"generation", status.generation},     {"state", phase_name(status.phase)},
                        {"world_size", status.world_size},     {"restarts", status.restarts},
                        {"last_failure", status.last_failure}, {"hang", hang_}};
  const JobSummary sum = summary();
  const auto optional_number = [](const std::optional<double>& v) {
    return v ? nlohmann::json(*v) : nlohmann::json(nullptr);
  };
  nlohmann::json summary_json = {{"ranks", sum.ranks},
                                 {"tokens_per_second", sum.tokens_per_second},
                                 {"samples_per_second", sum.samples_per_second},
                                 {"step_seconds", sum.step_seconds},
                                 {"mfu", optional_number(sum.mfu)},
                                 {"goodput", optional_number(sum.goodput)},
                                 {"loss", optional_number(sum.loss)}};
  nlohmann::json ranks = nlohmann::json::array();
  for (const auto& [rank, series] : series_) {
    nlohmann::json points = nlohmann::json::array();
    for (const StepPoint& p : series) points.push_back(point_json(p));
    nlohmann::json r = {{"rank", rank}, {"series", std::move(points)}};
    for (const auto& w : status.workers) {
      if (w.rank == rank) r["heartbeat_age_seconds"] = w.seconds_since_heartbeat;
    }
    if (const auto a = activity_.find(rank); a != activity_.end()) {
      r["activity"] = {{"step", a->second.step},
                       {"phase", a->second.phase},
                       {"collective", a->second.collective}};
    }
    ranks.push_back(std::move(r));
  }
  nlohmann::json stragglers = nlohmann::json::array();
  for (const Straggler& s : stragglers_) {
    stragglers.push_back({{"rank", s.rank},
                          {"busy_seconds", s.busy_seconds},
                          {"others_seconds", s.others_seconds},
                          {"ratio", s.ratio},
                          {"phase", s.phase},
                          {"phase_excess_seconds", s.phase_excess_seconds}});
  }
  nlohmann::json generations = nlohmann::json::array();
  for (const auto& [generation, start] : generation_start_)
    generations.push_back({{"generation", generation}, {"start_unix_time", start}});
  return nlohmann::json{{"job", std::move(job)},
                        {"summary", std::move(summary_json)},
                        {"ranks", std::move(ranks)},
                        {"stragglers", std::move(stragglers)},
                        {"generations", std::move(generations)},
                        {"straggler_threshold", options_.straggler_threshold},
                        {"straggler_window", options_.straggler_window}}
      .dump();
}

}  // namespace loom::control
