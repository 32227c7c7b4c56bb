// Traces (loom/metrics/trace.h): the step list, the recorder, StepTracer's file and the clock
// offset exchange. The merge is tests/unit/cli/trace_merge_test.cpp; a real 2-rank job's
// merged trace is tests/integration/observability_test.cpp.
#include "loom/metrics/trace.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <map>
#include <thread>

#include <unistd.h>

#include "harness/harness.h"
#include "loom/config.h"
#include "loom/error.h"
#include "loom/metrics/step_timer.h"
#include "loom/runtime.h"
#include "metrics/trace_internal.h"
#include "util/files.h"

namespace loom::metrics {
namespace {

using nlohmann::json;

TEST(TraceSteps, ParsesStepsRangesAndLists) {
  EXPECT_EQ(parse_trace_steps(""), std::vector<int64_t>{});
  EXPECT_EQ(parse_trace_steps("7"), std::vector<int64_t>{7});
  EXPECT_EQ(parse_trace_steps("10-12"), (std::vector<int64_t>{10, 11, 12}));
  EXPECT_EQ(parse_trace_steps("12, 3,10-12,0"), (std::vector<int64_t>{0, 3, 10, 11, 12}));
  EXPECT_EQ(parse_trace_steps("5-5"), std::vector<int64_t>{5});
}

TEST(TraceSteps, BadSpecsAreConfigErrorsNamingThem) {
  for (const std::string bad :
       {"x", "-1", "3-", "-", "1,,2", "1,", "2-1", "1.5", "+3", "0-100000"}) {
    const std::string error = testing::error_of<ConfigError>([&] { parse_trace_steps(bad); });
    EXPECT_TRUE(testing::contains(error, "metrics.trace_steps")) << bad << ": " << error;
    EXPECT_TRUE(testing::contains(error, "'" + bad + "'")) << bad << ": " << error;
  }
}

Runtime single_rank(const std::filesystem::path& run_dir) {
  const Config config = Config::load(
      Runtime::schema(),
      {.read_env = false, .overrides = {"run.dir=" + run_dir.string(), "log.level=warn"}});
  return Runtime::init(config, Topology{.rank = 0, .world_size = 1}, /*configure_process=*/false);
}

// The spans of a file, by name, each with its fields.
std::multimap<std::string, json> spans_of(const json& trace) {
  std::multimap<std::string, json> spans;
  for (const json& e : trace["traceEvents"]) {
    if (e["ph"] == "X") spans.emplace(e["name"].get<std::string>(), e);
  }
  return spans;
}

TEST(StepTracer, RecordsTheChosenStepsOnTheirThreadsAndWritesThemWhenTheyEnd) {
  testing::TempDir dir;
  Runtime rt = single_rank(dir.path());
  EXPECT_FALSE(tracing());
  StepTimer timer;
  int64_t before_us = 0, after_us = 0;
  int other_tid = 0;
  {
    StepTracer tracer(rt, {1});
    EXPECT_EQ(tracer.file(), dir.path() / "traces" / "rank_0.json");
    EXPECT_EQ(tracer.clock().offset_us, 0);
    for (int64_t step = 0; step < 3; ++step) {
      tracer.begin_step(step);
      EXPECT_EQ(tracing(), step == 1) << step;
      if (step == 1) before_us = trace_now_us();
      timer.begin_step();
      {
        auto phase = timer.phase(Phase::kForwardBackward);
        TraceSpan span("train", "forward");
        span.args(R"({"micro_batch":0})");
      }
      std::thread([&] {
        if (!tracing()) return;  // as a recording site does
        const int64_t start = trace_now_us();
        trace_span("collective", "all_reduce", start, start + 5, R"({"sequence":3})");
        other_tid = static_cast<int>(::gettid());
      }).join();
      timer.end_step();
      if (step == 1) {
        after_us = trace_now_us();
        EXPECT_FALSE(std::filesystem::exists(tracer.file())) << "written when step 1 ends";
      }
    }
    // Step 2's begin_step ended the chosen steps: the file is there.
    ASSERT_TRUE(std::filesystem::exists(tracer.file()));
  }
  EXPECT_FALSE(tracing());
  const json trace = json::parse(util::read_file(dir.path() / "traces" / "rank_0.json"));
  EXPECT_EQ(trace["displayTimeUnit"], "ms");
  const json& other = trace["otherData"];
  EXPECT_EQ(other["format"], "loom.trace");
  EXPECT_EQ(other["version"], 1);
  EXPECT_EQ(other["rank"], 0);
  EXPECT_EQ(other["world_size"], 1);
  EXPECT_EQ(other["steps"], json::array({1}));
  EXPECT_EQ(other["clock_offset_us"], 0.0);
  EXPECT_EQ(other["dropped_spans"], 0);
  // Exactly step 1's spans: the step, its phase, the forward span and the other thread's.
  const auto spans = spans_of(trace);
  ASSERT_EQ(spans.size(), 4u) << trace.dump(1);
  const json& step = spans.find("step 1")->second;
  const json& phase = spans.find("forward_backward")->second;
  const json& forward = spans.find("forward")->second;
  const json& collective = spans.find("all_reduce")->second;
  EXPECT_EQ(step["cat"], "step");
  EXPECT_EQ(step["args"], json({{"step", 1}}));
  EXPECT_EQ(phase["cat"], "phase");
  EXPECT_EQ(forward["cat"], "train");
  EXPECT_EQ(forward["args"], json({{"micro_batch", 0}}));
  EXPECT_EQ(collective["cat"], "collective");
  EXPECT_EQ(collective["args"], json({{"sequence", 3}}));
  EXPECT_EQ(collective["dur"], 5);
  for (const auto& [name, e] : spans) {
    EXPECT_EQ(e["ph"], "X");
    EXPECT_EQ(e["pid"], 0) << name;
    EXPECT_GE(e["ts"].get<int64_t>(), before_us) << name;
    EXPECT_LE(e["ts"].get<int64_t>() + e["dur"].get<int64_t>(), after_us) << name;
  }
  // Nesting on the training thread: step > phase > forward.
  EXPECT_EQ(step["tid"], phase["tid"]);
  EXPECT_EQ(step["tid"], forward["tid"]);
  EXPECT_EQ(collective["tid"], other_tid);
  EXPECT_NE(collective["tid"], step["tid"]);
  EXPECT_LE(step["ts"], phase["ts"]);
  EXPECT_LE(phase["ts"], forward["ts"]);
  EXPECT_LE(forward["ts"].get<int64_t>() + forward["dur"].get<int64_t>(),
            phase["ts"].get<int64_t>() + phase["dur"].get<int64_t>());
  EXPECT_LE(phase["ts"].get<int64_t>() + phase["dur"].get<int64_t>(),
            step["ts"].get<int64_t>() + step["dur"].get<int64_t>());
  // Every thread that recorded is named (metadata), and so is the process.
  std::map<int, std::string> threads;
  for (const json& e : trace["traceEvents"]) {
    if (e["ph"] == "M" && e["name"] == "thread_name") threads[e["tid"]] = e["args"]["name"];
    if (e["ph"] == "M" && e["name"] == "process_name") {
      EXPECT_EQ(e["args"]["name"], "rank 0");
    }
  }
  EXPECT_EQ(threads.size(), 2u);
  EXPECT_EQ(threads.count(step["tid"].get<int>()), 1u);
  EXPECT_EQ(threads.count(other_tid), 1u);
}

TEST(StepTracer, ArgsThatAreNotAJsonObjectAreKeptAsText) {
  testing::TempDir dir;
  Runtime rt = single_rank(dir.path());
  {
    StepTracer tracer(rt, {0});
    tracer.begin_step(0);
    TraceSpan span("model", "attention");
    span.args("heads=4");
  }
  const json trace = json::parse(util::read_file(dir.path() / "traces" / "rank_0.json"));
  const auto spans = spans_of(trace);
  ASSERT_EQ(spans.count("attention"), 1u);
  EXPECT_EQ(spans.find("attention")->second["args"], json({{"text", "heads=4"}}));
}

TEST(StepTracer, WithoutStepsRecordsNothingAndWritesNothing) {
  testing::TempDir dir;
  Runtime rt = single_rank(dir.path());
  {
    StepTracer tracer(rt, {});
    tracer.begin_step(0);
    EXPECT_FALSE(tracing());
    TraceSpan span("train", "forward");
    EXPECT_FALSE(span.recording());
    tracer.flush();
  }
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "traces"));
}

TEST(StepTracer, OnePerProcessRecords) {
  testing::TempDir dir;
  Runtime rt = single_rank(dir.path());
  StepTracer first(rt, {0});
  const std::string error = testing::error_of<InvalidArgument>([&] { StepTracer second(rt, {0}); });
  EXPECT_TRUE(testing::contains(error, "another StepTracer records in this process")) << error;
  StepTracer quiet(rt, {});  // one without steps is fine
}

TEST(StepTracer, AFailedWriteIsLoggedAndTrainingGoesOn) {
  testing::TempDir dir;
  Runtime rt = single_rank(dir.path());
  util::write_file_atomic(dir.path() / "traces", "a file where the directory would go");
  StepTracer tracer(rt, {0});
  tracer.begin_step(0);
  { TraceSpan span("train", "forward"); }
  EXPECT_NO_THROW(tracer.begin_step(1));  // the flush fails quietly
  const std::string error = testing::error_of<IoError>([&] { tracer.flush(); });
  EXPECT_TRUE(testing::contains(error, (dir.path() / "traces").string())) << error;
}

// Ranks as threads share one clock: every measured offset is 0 within its uncertainty (half
// the best round trip through the in-memory store), which is small.
TEST(ClockOffset, RanksOnOneClockMeasureAboutZero) {
  constexpr int kWorld = 3;
  std::vector<ClockOffset> offsets(kWorld);
  testing::expect_all_ok(testing::run_threads(kWorld, [&](testing::Rank& r) {
    offsets[r.rank] = internal::measure_clock_offset(r.store, "clock", r.rank, r.world, 8,
                                                     std::chrono::seconds(30));
  }));
  EXPECT_EQ(offsets[0].offset_us, 0);
  EXPECT_EQ(offsets[0].uncertainty_us, 0);
  for (int r = 1; r < kWorld; ++r) {
    EXPECT_GE(offsets[r].uncertainty_us, 0) << r;
    EXPECT_LT(offsets[r].uncertainty_us, 50'000) << r;
    // Timestamps are whole microseconds: the estimate may be off by one more.
    EXPECT_LE(std::abs(offsets[r].offset_us), offsets[r].uncertainty_us + 1) << r;
  }
}

}  // namespace
}  // namespace loom::metrics
