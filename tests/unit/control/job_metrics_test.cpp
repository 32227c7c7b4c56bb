// The coordinator's job-wide metrics (control/job_metrics.h): the bounded series, straggler
// detection and its log lines, and both renderings compared whole. The HTTP endpoint that
// serves them is tested in coordinator_test.cpp; Prometheus scraping a real job in
// tests/integration/observability_test.cpp.
#include "control/job_metrics.h"

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <nlohmann/json.hpp>

#include "harness/harness.h"
#include "loom/error.h"

namespace loom::control {
namespace {

using testing::error_of;

// A report of one step with `busy` seconds of work in `phase` and `wait` seconds in comm_wait.
StepPoint point(int64_t generation, int64_t step, double busy, double wait,
                const std::string& phase = "forward_backward") {
  StepPoint p;
  p.unix_time = 1000 + static_cast<double>(step);
  p.generation = generation;
  p.steps = 1;
  p.last_step = step;
  p.step_seconds = busy + wait + 0.01;
  p.phase_seconds = {{"data_wait", 0.004},
                     {"forward_backward", 0.0},
                     {"comm_wait", wait},
                     {"optimizer", 0.006},
                     {"other", 0}};
  p.phase_seconds[phase] += busy;
  p.tokens_per_second = 1000;
  p.samples_per_second = 10;
  return p;
}

MembershipStatus running(int64_t generation, int world) {
  MembershipStatus s;
  s.phase = Phase::kRunning;
  s.generation = generation;
  s.world_size = world;
  for (int r = 0; r < world; ++r) s.workers.push_back({.rank = r, .step = 0});
  return s;
}

TEST(JobMetrics, FlagsTheRankWhoseWorkExceedsTheOthersAndNamesThePhase) {
  JobMetrics m({.straggler_threshold = 1.3, .straggler_window = 3});
  // Synchronous steps: every rank's step takes the same wall time; rank 2 works 0.2 s in its
  // data loader, the others 0.1 s in forward/backward and wait for it in comm_wait.
  for (int64_t step = 0; step < 3; ++step) {
    for (int r = 0; r < 4; ++r) {
      m.record(r, r == 2 ? point(1, step, 0.2, 0.0, "data_wait") : point(1, step, 0.1, 0.1));
    }
    if (step < 2) {
      EXPECT_TRUE(m.stragglers().empty()) << "a window of 3 is not full yet";
    }
  }
  ASSERT_EQ(m.stragglers().size(), 1u);
  const Straggler& s = m.stragglers()[0];
  EXPECT_EQ(s.rank, 2);
  // busy = step - comm_wait = 0.2 + 0.01 against 0.1 + 0.01.
  EXPECT_NEAR(s.busy_seconds, 0.21, 1e-12);
  EXPECT_NEAR(s.others_seconds, 0.11, 1e-12);
  EXPECT_NEAR(s.ratio, 0.21 / 0.11, 1e-12);
  EXPECT_EQ(s.phase, "data_wait");
  EXPECT_NEAR(s.phase_excess_seconds, 0.2, 1e-12);
  const auto events = m.take_events();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_TRUE(events[0].warning);
  EXPECT_EQ(events[0].text,
            "rank 2 is a straggler: 0.210 s per step outside collective waits against the other "
            "ranks' median 0.110 s (1.91x, threshold 1.3x) over its last 3 reports; most of the "
            "difference is in data_wait (+0.200 s)");
  EXPECT_TRUE(m.take_events().empty());

  // Rank 2 catches up: once its window holds no slow report, the flag clears, said once.
  for (int64_t step = 3; step < 6; ++step) {
    for (int r = 0; r < 4; ++r) m.record(r, point(1, step, 0.1, 0.0));
  }
  EXPECT_TRUE(m.stragglers().empty());
  EXPECT_EQ(m.take_events(),
            (std::vector<JobMetrics::Event>{{false, "rank 2 is no longer a straggler"}}));
}

TEST(JobMetrics, ARankBelowTheThresholdOrAloneIsNotFlagged) {
  JobMetrics m({.straggler_threshold = 1.3, .straggler_window = 2});
  for (int64_t step = 0; step < 4; ++step) {
    m.record(0, point(1, step, 0.125, 0));
    m.record(1, point(1, step, 0.1, 0));
  }
  // busy: 0.135 s against 0.11 s = 1.23x, under 1.3x.
  EXPECT_TRUE(m.stragglers().empty());
  JobMetrics alone({.straggler_window = 1});
  alone.record(0, point(1, 0, 5.0, 0));
  EXPECT_TRUE(alone.stragglers().empty()) << "one rank has no others to be slower than";
}

TEST(JobMetrics, SeriesAreBoundedAndANewGenerationClearsTheFlags) {
  JobMetrics m({.history = 5, .straggler_window = 2});
  for (int64_t step = 0; step < 12; ++step) {
    m.record(0, point(1, step, 0.1, 0.3));
    m.record(1, point(1, step, 0.4, 0.0));
  }
  EXPECT_EQ(m.series().at(0).size(), 5u);
  EXPECT_EQ(m.series().at(0).front().last_step, 7);
  ASSERT_EQ(m.stragglers().size(), 1u);
  m.take_events();
  // Generation 2 (a restart) with rank 0 only so far: the flags of generation 1 are gone, and
  // a late report of generation 1 is dropped.
  m.record(0, point(2, 0, 0.1, 0.0));
  EXPECT_EQ(m.generation(), 2);
  EXPECT_TRUE(m.stragglers().empty());
  EXPECT_EQ(m.take_events(),
            (std::vector<JobMetrics::Event>{{false, "generation 2: straggler flags cleared"}}));
  m.record(1, point(1, 12, 0.4, 0.0));
  EXPECT_EQ(m.series().at(1).back().last_step, 11);
}

TEST(JobMetrics, PrometheusTextIsTheWholeExposition) {
  JobMetrics m({.straggler_window = 1});
  // Binary fractions, so that every figure prints exactly.
  StepPoint p0;
  p0.generation = 3;
  p0.steps = 2;
  p0.last_step = 41;
  p0.step_seconds = 0.375;
  p0.phase_seconds = {{"data_wait", 0.0625}, {"forward_backward", 0.1875}, {"comm_wait", 0.125}};
  p0.tokens_per_second = 1000;
  p0.samples_per_second = 10;
  p0.mfu = 0.25;
  p0.rss_bytes = 1 << 20;
  p0.loss = 2.5;
  p0.goodput = 0.75;
  StepPoint p1 = p0;
  p1.tokens_per_second = 3000;
  p1.mfu = -1;
  p1.rss_bytes = 0;
  m.record(0, p0);
  m.record(1, p1);
  MembershipStatus status = running(3, 2);
  status.restarts = 2;
  status.workers[0].seconds_since_heartbeat = 0.5;
  status.workers[1].seconds_since_heartbeat = 0.25;
  const std::string expected =
      R"(# HELP loom_generation The generation the job runs (a new one after every restart or membership change).
# TYPE loom_generation gauge
loom_generation 3
# HELP loom_restarts_total Generations ended by a failure.
# TYPE loom_restarts_total counter
loom_restarts_total 2
# HELP loom_world_size Workers in the current generation.
# TYPE loom_world_size gauge
loom_world_size 2
# HELP loom_job_running 1 while a generation runs, else 0.
# TYPE loom_job_running gauge
loom_job_running 1
# HELP loom_job_tokens_per_second Tokens trained per second, summed over the ranks' newest reports.
# TYPE loom_job_tokens_per_second gauge
loom_job_tokens_per_second 4000
# HELP loom_job_samples_per_second Samples trained per second, summed over the ranks' newest reports.
# TYPE loom_job_samples_per_second gauge
loom_job_samples_per_second 20
# HELP loom_job_step_seconds The median over ranks of their newest mean step time.
# TYPE loom_job_step_seconds gauge
loom_job_step_seconds 0.375
# HELP loom_job_mfu_ratio Model FLOPs utilisation, the mean of the ranks' newest.
# TYPE loom_job_mfu_ratio gauge
loom_job_mfu_ratio 0.25
# HELP loom_job_goodput_ratio Productive time over wall time since the job started, as rank 0 accounts it.
# TYPE loom_job_goodput_ratio gauge
loom_job_goodput_ratio 0.75
# HELP loom_job_loss The newest step's loss (the mean over ranks).
# TYPE loom_job_loss gauge
loom_job_loss 2.5
# HELP loom_job_stragglers Ranks flagged as stragglers now.
# TYPE loom_job_stragglers gauge
loom_job_stragglers 0
# HELP loom_job_hung 1 while no rank has finished a step for longer than the hang threshold, else 0.
# TYPE loom_job_hung gauge
loom_job_hung 0
# HELP loom_rank_heartbeat_age_seconds Seconds since the rank's last heartbeat.
# TYPE loom_rank_heartbeat_age_seconds gauge
loom_rank_heartbeat_age_seconds{rank="0"} 0.5
loom_rank_heartbeat_age_seconds{rank="1"} 0.25
# HELP loom_rank_step The newest step the rank finished (0-based).
# TYPE loom_rank_step gauge
loom_rank_step{rank="0"} 41
loom_rank_step{rank="1"} 41
# HELP loom_rank_step_seconds Mean step time over the rank's newest report.
# TYPE loom_rank_step_seconds gauge
loom_rank_step_seconds{rank="0"} 0.375
loom_rank_step_seconds{rank="1"} 0.375
# HELP loom_rank_busy_seconds Mean step time outside collective waits (comm_wait) over the newest report.
# TYPE loom_rank_busy_seconds gauge
loom_rank_busy_seconds{rank="0"} 0.25
loom_rank_busy_seconds{rank="1"} 0.25
# HELP loom_rank_phase_seconds Mean time per step in each phase over the rank's newest report.
# TYPE loom_rank_phase_seconds gauge
loom_rank_phase_seconds{rank="0",phase="comm_wait"} 0.125
loom_rank_phase_seconds{rank="0",phase="data_wait"} 0.0625
loom_rank_phase_seconds{rank="0",phase="forward_backward"} 0.1875
loom_rank_phase_seconds{rank="1",phase="comm_wait"} 0.125
loom_rank_phase_seconds{rank="1",phase="data_wait"} 0.0625
loom_rank_phase_seconds{rank="1",phase="forward_backward"} 0.1875
# HELP loom_rank_tokens_per_second Tokens per second over the rank's newest report.
# TYPE loom_rank_tokens_per_second gauge
loom_rank_tokens_per_second{rank="0"} 1000
loom_rank_tokens_per_second{rank="1"} 3000
# HELP loom_rank_samples_per_second Samples per second over the rank's newest report.
# TYPE loom_rank_samples_per_second gauge
loom_rank_samples_per_second{rank="0"} 10
loom_rank_samples_per_second{rank="1"} 10
# HELP loom_rank_mfu_ratio Model FLOPs utilisation over the rank's newest report.
# TYPE loom_rank_mfu_ratio gauge
loom_rank_mfu_ratio{rank="0"} 0.25
# HELP loom_rank_resident_memory_bytes Resident memory of the rank's process.
# TYPE loom_rank_resident_memory_bytes gauge
loom_rank_resident_memory_bytes{rank="0"} 1048576
loom_rank_resident_memory_bytes{rank="1"} 0
# HELP loom_rank_straggler 1 while the rank is flagged as a straggler, else 0.
# TYPE loom_rank_straggler gauge
loom_rank_straggler{rank="0"} 0
loom_rank_straggler{rank="1"} 0
)";
  EXPECT_EQ(m.prometheus(status), expected);
}

TEST(JobMetrics, BeforeAnyStepOnlyTheJobIsExposed) {
  JobMetrics m;
  MembershipStatus status;  // gathering, no workers yet
  EXPECT_EQ(m.prometheus(status),
            "# HELP loom_generation The generation the job runs (a new one after every restart "
            "or membership change).\n# TYPE loom_generation gauge\nloom_generation 0\n"
            "# HELP loom_restarts_total Generations ended by a failure.\n"
            "# TYPE loom_restarts_total counter\nloom_restarts_total 0\n"
            "# HELP loom_world_size Workers in the current generation.\n"
            "# TYPE loom_world_size gauge\nloom_world_size 0\n"
            "# HELP loom_job_running 1 while a generation runs, else 0.\n"
            "# TYPE loom_job_running gauge\nloom_job_running 0\n"
            "# HELP loom_job_stragglers Ranks flagged as stragglers now.\n"
            "# TYPE loom_job_stragglers gauge\nloom_job_stragglers 0\n"
            "# HELP loom_job_hung 1 while no rank has finished a step for longer than the hang "
            "threshold, else 0.\n# TYPE loom_job_hung gauge\nloom_job_hung 0\n");
}

TEST(JobMetrics, JsonHoldsEverySeriesPointAndTheStragglers) {
  JobMetrics m({.straggler_window = 1});
  StepPoint slow = point(1, 0, 0.5, 0);
  slow.mfu = 0.125;
  m.record(0, point(1, 0, 0.1, 0.4));
  m.record(1, slow);
  m.record(0, point(2, 1, 0.1, 0.0));
  const auto j = nlohmann::json::parse(m.json(running(2, 2)));
  EXPECT_EQ(j["job"], (nlohmann::json{{"generation", 2},
                                      {"state", "running"},
                                      {"world_size", 2},
                                      {"restarts", 0},
                                      {"last_failure", ""},
                                      {"hang", ""}}));
  // Generation 2's figures: rank 0's report only (rank 1's is of generation 1).
  EXPECT_EQ(j["summary"], (nlohmann::json{{"ranks", 1},
                                          {"tokens_per_second", 1000.0},
                                          {"samples_per_second", 10.0},
                                          {"step_seconds", point(2, 1, 0.1, 0.0).step_seconds},
                                          {"mfu", nullptr},
                                          {"goodput", 0.0},
                                          {"loss", 0.0}}));
  ASSERT_EQ(j["ranks"].size(), 2u);
  EXPECT_EQ(j["ranks"][0]["rank"], 0);
  ASSERT_EQ(j["ranks"][0]["series"].size(), 2u);
  const auto& first = j["ranks"][1]["series"][0];
  EXPECT_EQ(first, (nlohmann::json{{"unix_time", 1000.0},
                                   {"generation", 1},
                                   {"steps", 1},
                                   {"last_step", 0},
                                   {"step_seconds", slow.step_seconds},
                                   {"busy_seconds", slow.busy_seconds()},
                                   {"phase_seconds", slow.phase_seconds},
                                   {"tokens_per_second", 1000.0},
                                   {"samples_per_second", 10.0},
                                   {"mfu", 0.125},
                                   {"rss_bytes", 0},
                                   {"loss", 0.0},
                                   {"goodput", 0.0}}));
  EXPECT_TRUE(j["ranks"][0]["series"][0]["mfu"].is_null());
  EXPECT_EQ(j["ranks"][0]["heartbeat_age_seconds"], 0.0);
  // Rank 1 was flagged in generation 1; generation 2 cleared it.
  EXPECT_EQ(j["stragglers"], nlohmann::json::array());
  EXPECT_EQ(j["generations"], (nlohmann::json{{{"generation", 1}, {"start_unix_time", 1000.0}},
                                              {{"generation", 2}, {"start_unix_time", 1001.0}}}));
}

TEST(JobMetrics, TheWatchdogNamesEachRanksPhaseAndCollectiveOnceWhenNoStepFinishes) {
  JobMetrics m({.hang_factor = 10, .hang_min_seconds = 2});
  m.observe(0, 1, {.step = 4, .phase = "forward_backward"}, 100.0);
  EXPECT_FALSE(m.check_hang(500.0)) << "no step time to scale by yet";
  m.record(0, point(1, 4, 0.1, 0));
  m.record(1, point(1, 4, 0.1, 0));
  // Step 5 finishes at 101; then rank 1 blocks in its data source and rank 0 waits for it in
  // the gradient all-reduce. The threshold: max(2 s, 10 x the median step 0.11 s) = 2 s.
  m.observe(0, 1,
            {.step = 5,
             .phase = "comm_wait",
             .collective = "all_reduce #12 on world (float32 x 64), started 1.0 s ago"},
            101.0);
  m.observe(1, 1, {.step = 5, .phase = "data_wait"}, 101.0);
  EXPECT_FALSE(m.check_hang(102.9));
  EXPECT_TRUE(m.take_events().empty());
  ASSERT_TRUE(m.check_hang(103.0));
  const std::string expected =
      "no rank has finished a step for 2.0 s (threshold 2.0 s: 10x the median step time 0.110 s, "
      "at least 2 s); rank 0: step 5, comm_wait, waiting in all_reduce #12 on world (float32 x "
      "64), started 1.0 s ago; rank 1: step 5, data_wait, in no collective. Outside "
      "collectives: rank 1 (data_wait)";
  EXPECT_EQ(m.hang(), expected);
  EXPECT_EQ(m.take_events(), (std::vector<JobMetrics::Event>{{true, "hang: " + expected}}));
  EXPECT_FALSE(m.check_hang(200.0)) << "one hang is reported once";
  EXPECT_NE(m.prometheus(running(1, 2)).find("\nloom_job_hung 1\n"), std::string::npos);
  EXPECT_EQ(nlohmann::json::parse(m.json(running(1, 2)))["ranks"][1]["activity"],
            (nlohmann::json{{"step", 5}, {"phase", "data_wait"}, {"collective", ""}}));
  // Heartbeats without a newer step change nothing; a finished step ends the hang and re-arms.
  m.observe(1, 1, {.step = 5, .phase = "data_wait"}, 300.0);
  EXPECT_FALSE(m.hang().empty());
  m.observe(1, 1, {.step = 6, .phase = "forward_backward"}, 301.0);
  EXPECT_EQ(m.hang(), "");
  EXPECT_EQ(m.take_events(),
            (std::vector<JobMetrics::Event>{{false, "the job progresses again: step 6 finished"}}));
  EXPECT_FALSE(m.check_hang(302.9));
  EXPECT_TRUE(m.check_hang(303.0));
}

TEST(JobMetrics, EveryRankInACollectiveIsSaidAndTheWatchdogCanBeOff) {
  JobMetrics m({.hang_min_seconds = 0});
  m.record(0, point(1, 0, 0.25, 0));  // step 0.26 s: threshold 2.6 s
  m.observe(0, 1, {.step = 0, .phase = "comm_wait", .collective = "barrier #3 on control"}, 10.0);
  EXPECT_FALSE(m.check_hang(12.5));
  ASSERT_TRUE(m.check_hang(12.7));
  EXPECT_EQ(m.hang(),
            "no rank has finished a step for 2.7 s (threshold 2.6 s: 10x the median step time "
            "0.260 s, at least 0 s); rank 0: step 0, comm_wait, waiting in barrier #3 on control. "
            "Outside collectives: none (every rank waits in a collective: compare the flight "
            "dumps)");
  JobMetrics off({.hang_factor = 0});
  off.record(0, point(1, 0, 0.25, 0));
  off.observe(0, 1, {.step = 0}, 10.0);
  EXPECT_FALSE(off.check_hang(1e9));
  EXPECT_NE(error_of<InvalidArgument>([] {
              RankActivity{.phase = std::string(65, 'a')}.check();
            }).find("phase is at most 64 bytes, got 65"),
            std::string::npos);
}

TEST(JobMetrics, ReportsFromTheNetworkAreCheckedFieldByField) {
  EXPECT_NO_THROW(point(1, 0, 0.1, 0.1).check());
  const auto refused = [](const std::function<void(StepPoint&)>& spoil) {
    StepPoint p = point(1, 0, 0.1, 0.1);
    spoil(p);
    return error_of<InvalidArgument>([&] { p.check(); });
  };
  EXPECT_EQ(refused([](StepPoint& p) { p.steps = 0; }),
            "a step report needs steps >= 1 and last_step >= 0, got 0 and 0");
  EXPECT_EQ(refused([](StepPoint& p) { p.step_seconds = -1; }),
            "step report field step_seconds must be finite and >= 0, got -1");
  EXPECT_EQ(refused([](StepPoint& p) { p.tokens_per_second = std::nan(""); }),
            "step report field tokens_per_second must be finite and >= 0, got nan");
  EXPECT_EQ(refused([](StepPoint& p) { p.mfu = INFINITY; }),
            "step report field mfu must be finite, got inf");
  EXPECT_EQ(refused([](StepPoint& p) { p.phase_seconds["x\"} 1\nloom_fake"] = 0; }),
            "step report phase names are [a-z_]{1,64}, got 'x\"} 1\nloom_fake'");
  EXPECT_EQ(refused([](StepPoint& p) { p.phase_seconds["data_wait"] = INFINITY; }),
            "step report field phase_seconds[data_wait] must be finite and >= 0, got inf");
  EXPECT_EQ(refused([](StepPoint& p) {
              for (char c = 'a'; c <= 'q'; ++c) p.phase_seconds[std::string(1, c)] = 0;
            }),
            "a step report has at most 16 phases, got 22");  // 5 + 17
  StepPoint diverged = point(1, 0, 0.1, 0.1);
  diverged.loss = std::nan("");
  EXPECT_NO_THROW(diverged.check()) << "a NaN loss is what the metrics should show";
}

TEST(JobMetrics, BadOptionsAreNamed) {
  EXPECT_NE(error_of<InvalidArgument>([] {
              JobMetrics({.straggler_threshold = 1.0});
            }).find("straggler threshold is a ratio above 1"),
            std::string::npos);
  EXPECT_NE(error_of<InvalidArgument>([] {
              JobMetrics({.history = 4, .straggler_window = 5});
            }).find("straggler window must be in [1, history = 4] reports, got 5"),
            std::string::npos);
}

}  // namespace
}  // namespace loom::control
