// MetricsLogger: throughput and MFU arithmetic, metrics.jsonl lines, progress lines, and the
// goodput account across two loggers over one run dir.
#include "loom/metrics/logger.h"

#include <gtest/gtest.h>
#include <spdlog/sinks/ostream_sink.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <sstream>

#include "harness/harness.h"
#include "loom/error.h"
#include "loom/runtime.h"

namespace loom::metrics {
namespace {

struct CapturedLog {
  std::ostringstream out;
  std::shared_ptr<spdlog::logger> logger = std::make_shared<spdlog::logger>(
      "metrics-test", std::make_shared<spdlog::sinks::ostream_sink_mt>(out));
};

std::vector<nlohmann::json> read_jsonl(const std::filesystem::path& file) {
  std::vector<nlohmann::json> lines;
  std::ifstream in(file);
  std::string line;
  while (std::getline(in, line)) lines.push_back(nlohmann::json::parse(line));
  return lines;
}

StepTimes times(double data, double fb, double opt, double ckpt = 0) {
  StepTimes t;
  t[Phase::kDataWait] = data;
  t[Phase::kForwardBackward] = fb;
  t[Phase::kOptimizer] = opt;
  t[Phase::kCheckpointStall] = ckpt;
  t.total = data + fb + opt + ckpt;
  return t;
}

MetricsOptions options() {
  MetricsOptions o;
  o.flops_per_token = 1e6;
  o.peak = {1e11, "measured-cpu-matmul"};
  o.tty = false;
  o.log_every = 2;
  o.smoothing = 0.5;
  return o;
}

TEST(MetricsLogger, ThroughputAndMfuByHand) {
  testing::TempDir dir;
  CapturedLog log;
  MetricsLogger logger(dir.path(), true, *log.logger, options());
  // 4096 tokens in 0.5 s = 8192 tok/s; 8192 * 1e6 / 1e11 = 8.192% MFU.
  StepMetrics m = logger.log_step({.step = 0,
                                   .loss = 5.0,
                                   .lr = 1e-3,
                                   .tokens = 4096,
                                   .samples = 16,
                                   .times = times(0.05, 0.4, 0.05)});
  EXPECT_DOUBLE_EQ(m.tokens_per_second, 8192);
  EXPECT_DOUBLE_EQ(m.samples_per_second, 32);
  ASSERT_TRUE(m.mfu.has_value());
  EXPECT_NEAR(*m.mfu, 0.08192, 1e-12);
  // The debiased EMA starts at the first value.
  EXPECT_DOUBLE_EQ(m.tokens_per_second_smoothed, 8192);
  // Second step twice as fast: EMA(0.5) debiased = (0.25*8192 + 0.5*16384) / 0.75.
  m = logger.log_step({.step = 1,
                       .loss = 4.0,
                       .lr = 1e-3,
                       .tokens = 4096,
                       .samples = 16,
                       .times = times(0.0, 0.25, 0.0)});
  EXPECT_DOUBLE_EQ(m.tokens_per_second, 16384);
  EXPECT_NEAR(m.tokens_per_second_smoothed, (0.25 * 8192 + 0.5 * 16384) / 0.75, 1e-9);
  EXPECT_NEAR(*m.mfu_smoothed, m.tokens_per_second_smoothed * 1e6 / 1e11, 1e-12);
}

TEST(MetricsLogger, WithoutFlopsOrPeakThereIsNoMfu) {
  testing::TempDir dir;
  CapturedLog log;
  MetricsOptions o = options();
  o.flops_per_token = 0;
  MetricsLogger logger(dir.path(), true, *log.logger, o);
  StepMetrics m = logger.log_step({.step = 0, .samples = 64, .times = times(0, 0.1, 0)});
  EXPECT_FALSE(m.mfu.has_value());
  const auto lines = read_jsonl(dir / "metrics.jsonl");
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_TRUE(lines[0]["mfu"].is_null());
  EXPECT_TRUE(lines[0]["grad_norm"].is_null());
}

TEST(MetricsLogger, EveryStepIsOneParsableJsonLineWithEveryField) {
  testing::TempDir dir;
  CapturedLog log;
  {
    MetricsLogger logger(dir.path(), true, *log.logger, options());
    for (int64_t step = 0; step < 5; ++step) {
      logger.log_step({.step = step,
                       .epoch = 0,
                       .loss = 5.0 - step,
                       .lr = 1e-3 * (step + 1),
                       .grad_norm = 0.5,
                       .tokens = 1024,
                       .samples = 8,
                       .times = times(0.01, 0.08, 0.01)});
    }
  }
  const auto lines = read_jsonl(dir / "metrics.jsonl");
  ASSERT_EQ(lines.size(), 5u);
  for (const char* field : {"step",
                            "epoch",
                            "session",
                            "time",
                            "loss",
                            "lr",
                            "grad_norm",
                            "tokens",
                            "samples",
                            "step_seconds",
                            "tokens_per_s",
                            "samples_per_s",
                            "tokens_per_s_smoothed",
                            "samples_per_s_smoothed",
                            "mfu",
                            "mfu_smoothed",
                            "peak_flops",
                            "peak_source",
                            "phases",
                            "rss_bytes",
                            "peak_rss_bytes",
                            "goodput",
                            "productive_seconds",
                            "lost_seconds",
                            "wall_seconds"}) {
    EXPECT_TRUE(lines[4].contains(field)) << field;
  }
  EXPECT_EQ(lines[3]["step"], 3);
  EXPECT_DOUBLE_EQ(lines[3]["loss"].get<double>(), 2.0);
  EXPECT_DOUBLE_EQ(lines[3]["lr"].get<double>(), 4e-3);
  EXPECT_EQ(lines[3]["peak_source"], "measured-cpu-matmul");
  EXPECT_DOUBLE_EQ(lines[3]["phases"]["forward_backward"].get<double>(), 0.08);
  double sum = 0;
  for (const auto& [name, seconds] : lines[3]["phases"].items()) sum += seconds.get<double>();
  EXPECT_NEAR(sum, lines[3]["step_seconds"].get<double>(), 1e-12);
  EXPECT_GT(lines[3]["rss_bytes"].get<int64_t>(), 0);
  // Not a TTY: a log line every log_every (2) steps, after steps 1 and 3.
  const std::string printed = log.out.str();
  EXPECT_NE(printed.find("step 1 |"), std::string::npos) << printed;
  EXPECT_NE(printed.find("step 3 |"), std::string::npos) << printed;
  EXPECT_EQ(printed.find("step 2 |"), std::string::npos) << printed;
  EXPECT_NE(printed.find("MFU"), std::string::npos) << printed;
}

TEST(MetricsLogger, OwnTimerIsUsedWhenTheRecordHasNoTimes) {
  testing::TempDir dir;
  CapturedLog log;
  MetricsLogger logger(dir.path(), true, *log.logger, options());
  logger.timer().begin_step();
  { auto p = logger.timer().phase(Phase::kForwardBackward); }
  StepMetrics m = logger.log_step({.step = 0, .tokens = 10});
  EXPECT_GT(m.times.total, 0);
  EXPECT_FALSE(logger.timer().in_step());
}

TEST(MetricsLogger, GoodputSurvivesARestartAndCheckpointStallIsNotProductive) {
  testing::TempDir dir;
  CapturedLog log;
  {
    MetricsLogger first(dir.path(), true, *log.logger, options());
    first.on_resume(0);
    for (int64_t step = 0; step < 4; ++step) {
      first.log_step({.step = step, .tokens = 1, .times = times(0, 1.0, 0, 0.5)});
    }
    first.on_checkpoint_committed(4);
    first.log_step({.step = 4, .tokens = 1, .times = times(0, 1.0, 0)});  // lost below
  }
  MetricsLogger second(dir.path(), true, *log.logger, options());
  second.on_resume(4);
  StepMetrics m = second.log_step({.step = 4, .tokens = 1, .times = times(0, 1.0, 0)});
  EXPECT_EQ(m.goodput.sessions, 2);
  EXPECT_DOUBLE_EQ(m.goodput.productive_seconds, 4 * 1.0 + 1.0);
  EXPECT_DOUBLE_EQ(m.goodput.lost_seconds, 1.0);
  // metrics.jsonl is appended to: both sessions' lines are there, step 4 twice.
  const auto lines = read_jsonl(dir / "metrics.jsonl");
  ASSERT_EQ(lines.size(), 6u);
  EXPECT_EQ(lines[4]["session"], 1);
  EXPECT_EQ(lines[5]["session"], 2);
  EXPECT_EQ(lines[5]["step"], 4);
}

TEST(MetricsLogger, OtherRanksWriteNothing) {
  testing::TempDir dir;
  CapturedLog log;
  {
    MetricsLogger logger(dir.path(), false, *log.logger, options());
    for (int64_t step = 0; step < 4; ++step) {
      logger.log_step({.step = step, .tokens = 1, .times = times(0, 0.1, 0)});
    }
    logger.on_checkpoint_committed(4);
  }
  EXPECT_FALSE(std::filesystem::exists(dir / "metrics.jsonl"));
  EXPECT_FALSE(std::filesystem::exists(dir / "goodput.json"));
  EXPECT_TRUE(log.out.str().empty());
}

TEST(MetricsLogger, OnATerminalTheLineIsRedrawnAndStillLoggedEveryLogEvery) {
  testing::TempDir dir;
  CapturedLog log;
  MetricsOptions o = options();
  o.tty = true;
  o.log_every = 3;
  ::testing::internal::CaptureStderr();
  {
    MetricsLogger logger(dir.path(), true, *log.logger, o);
    for (int64_t step = 0; step < 3; ++step) {
      logger.log_step({.step = step, .tokens = 1, .times = times(0, 0.1, 0)});
    }
  }
  const std::string terminal = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(terminal.find("\r\x1b[Kstep 0 |"), std::string::npos) << terminal;
  EXPECT_NE(terminal.find("\r\x1b[Kstep 2 |"), std::string::npos) << terminal;
  EXPECT_EQ(terminal.back(), '\n');  // the destructor ends the open line
  const std::string logged = log.out.str();
  EXPECT_NE(logged.find("step 2 |"), std::string::npos) << logged;
  EXPECT_EQ(logged.find("step 1 |"), std::string::npos) << logged;
}

TEST(MetricsLogger, ProgressLineNamesTheFigures) {
  StepMetrics m;
  m.record = {.step = 120, .epoch = 1, .loss = 3.25, .lr = 3e-4, .grad_norm = 1.5, .tokens = 2048};
  m.times = times(0.1, 0.8, 0.1);
  m.tokens_per_second_smoothed = 12345;
  m.mfu_smoothed = 0.213;
  m.goodput.goodput = 0.93;
  m.memory.rss_bytes = int64_t{3} << 29;
  const std::string line = MetricsLogger::progress_line(m);
  EXPECT_NE(line.find("step 120 | epoch 1 | loss 3.2500 | lr 3.00e-04 | gnorm 1.50"),
            std::string::npos)
      << line;
  EXPECT_NE(line.find("12.3k tok/s"), std::string::npos) << line;
  EXPECT_NE(line.find("MFU 21.3%"), std::string::npos) << line;
  EXPECT_NE(line.find("data 10% fwd/bwd 80% opt 10%"), std::string::npos) << line;
  EXPECT_NE(line.find("rss 1.50 GiB | goodput 93.0%"), std::string::npos) << line;
}

// Through a Runtime: files in its run dir on rank 0, nothing written on rank 1.
TEST(MetricsLogger, UsesTheRuntimesRunDirAndRank) {
  testing::TempDir dir;
  for (int rank : {0, 1}) {
    const std::filesystem::path run = dir / ("run" + std::to_string(rank));
    Config config = Config::load(
        Runtime::schema(),
        {.read_env = false, .overrides = {"run.dir=" + run.string(), "log.level=warn"}});
    Runtime rt = Runtime::init(config, Topology{.rank = rank, .world_size = 2},
                               /*configure_process=*/false);
    {
      MetricsLogger logger(rt, options());
      logger.log_step({.step = 0, .tokens = 8, .times = times(0, 0.1, 0)});
    }
    EXPECT_EQ(std::filesystem::exists(run / "metrics.jsonl"), rank == 0) << rank;
    EXPECT_EQ(std::filesystem::exists(run / "goodput.json"), rank == 0) << rank;
  }
}

TEST(MetricsLogger, BadOptionsAreInvalidArgument) {
  testing::TempDir dir;
  CapturedLog log;
  MetricsOptions o = options();
  o.smoothing = 1.0;
  EXPECT_THROW(MetricsLogger(dir.path(), true, *log.logger, o), InvalidArgument);
  o = options();
  o.log_every = 0;
  EXPECT_THROW(MetricsLogger(dir.path(), true, *log.logger, o), InvalidArgument);
}

}  // namespace
}  // namespace loom::metrics
