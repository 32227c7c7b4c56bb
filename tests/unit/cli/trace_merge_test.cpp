// `loom trace`'s merge (tools/loom/trace_merge.h): ranks become processes on rank 0's clock,
// times relative to the first span, in time order; bad files are named.
#include "trace_merge.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "harness/harness.h"
#include "loom/error.h"
#include "util/files.h"

namespace loom::cli {
namespace {

using nlohmann::json;

json span(const std::string& name, const std::string& cat, int64_t ts, int64_t dur, int tid,
          json args = nullptr) {
  json e = {{"name", name}, {"cat", cat}, {"ph", "X"}, {"ts", ts},
            {"dur", dur},   {"pid", 99},  {"tid", tid}};
  if (!args.is_null()) e["args"] = std::move(args);
  return e;
}

json rank_file(int rank, double offset, double uncertainty, std::vector<json> spans) {
  json events = json::array({{{"name", "thread_name"},
                              {"ph", "M"},
                              {"pid", 99},
                              {"tid", 10 + rank},
                              {"args", {{"name", "train"}}}}});
  for (json& s : spans) events.push_back(std::move(s));
  return {{"traceEvents", events},
          {"displayTimeUnit", "ms"},
          {"otherData",
           {{"format", "loom.trace"},
            {"version", 1},
            {"rank", rank},
            {"world_size", 2},
            {"steps", {4}},
            {"clock_offset_us", offset},
            {"clock_uncertainty_us", uncertainty},
            {"dropped_spans", 0}}}};
}

TEST(TraceMerge, PutsEveryRankOnRankZerosClockInTimeOrder) {
  testing::TempDir dir;
  // Rank 1's clock runs 1000 us behind rank 0's: its spans move 1000 us later.
  util::write_file_atomic(dir / "rank_0.json",
                          rank_file(0, 0, 0,
                                    {span("step 4", "step", 5000, 300, 10, {{"step", 4}}),
                                     span("all_reduce", "collective", 5100, 50, 20,
                                          {{"group", "world"}, {"sequence", 7}})})
                              .dump());
  util::write_file_atomic(dir / "rank_1.json",
                          rank_file(1, 1000, 40,
                                    {span("step 4", "step", 4050, 200, 11, {{"step", 4}}),
                                     span("all_reduce", "collective", 4090, 70, 21,
                                          {{"group", "world"}, {"sequence", 7}})})
                              .dump());
  util::write_file_atomic(dir / "job.json", "{}");       // not a rank file: ignored
  util::write_file_atomic(dir / "rank_x.json", "nope");  // nor this
  const MergedTrace merged = merge_traces(dir.path());
  EXPECT_EQ(merged.ranks, (std::vector<int>{0, 1}));
  EXPECT_EQ(merged.spans, 4u);
  EXPECT_EQ(merged.steps, std::vector<int64_t>{4});
  EXPECT_EQ(merged.clock_offsets_us, (std::vector<double>{0, 1000}));
  EXPECT_EQ(merged.clock_uncertainties_us, (std::vector<double>{0, 40}));
  EXPECT_DOUBLE_EQ(merged.duration_ms, 0.3);  // 5000 .. 5300 on rank 0's clock
  EXPECT_EQ(merged.step_ms, (std::map<int64_t, std::map<int, double>>{{4, {{0, 0.3}, {1, 0.2}}}}));

  const json out = json::parse(merged.json);
  const json expected_events = json::array({
      {{"name", "thread_name"},
       {"ph", "M"},
       {"pid", 0},
       {"tid", 10},
       {"args", {{"name", "train"}}}},
      {{"name", "thread_name"},
       {"ph", "M"},
       {"pid", 1},
       {"tid", 11},
       {"args", {{"name", "train"}}}},
      {{"name", "step 4"},
       {"cat", "step"},
       {"ph", "X"},
       {"ts", 0.0},
       {"dur", 300},
       {"pid", 0},
       {"tid", 10},
       {"args", {{"step", 4}}}},
      {{"name", "step 4"},
       {"cat", "step"},
       {"ph", "X"},
       {"ts", 50.0},
       {"dur", 200},
       {"pid", 1},
       {"tid", 11},
       {"args", {{"step", 4}}}},
      {{"name", "all_reduce"},
       {"cat", "collective"},
       {"ph", "X"},
       {"ts", 90.0},
       {"dur", 70},
       {"pid", 1},
       {"tid", 21},
       {"args", {{"group", "world"}, {"sequence", 7}}}},
      {{"name", "all_reduce"},
       {"cat", "collective"},
       {"ph", "X"},
       {"ts", 100.0},
       {"dur", 50},
       {"pid", 0},
       {"tid", 20},
       {"args", {{"group", "world"}, {"sequence", 7}}}},
  });
  EXPECT_EQ(out["traceEvents"], expected_events) << out["traceEvents"].dump(1);
  EXPECT_EQ(out["displayTimeUnit"], "ms");
  EXPECT_EQ(out["otherData"], json({{"format", "loom.trace.merged"},
                                    {"version", 1},
                                    {"ranks", {0, 1}},
                                    {"steps", {4}},
                                    {"origin_us", 5000},
                                    {"clock_offsets_us", {0.0, 1000.0}},
                                    {"clock_uncertainties_us", {0.0, 40.0}}}));
}

TEST(TraceMerge, NoTracesIsAnIoErrorSayingHowToMakeThem) {
  testing::TempDir dir;
  const std::string error = testing::error_of<IoError>([&] { merge_traces(dir.path()); });
  EXPECT_EQ(error, "no traces (rank_<r>.json) in " + dir.path().string() +
                       ": run the job with metrics.trace_steps set (e.g. "
                       "--metrics.trace_steps=10-12)");
}

TEST(TraceMerge, AFileThatIsNotALoomTraceIsCorruptDataNamingIt) {
  const json good = rank_file(0, 0, 0, {span("step 4", "step", 1, 2, 3)});
  json wrong_rank = good;
  wrong_rank["otherData"]["rank"] = 1;
  json other_format = good;
  other_format["otherData"]["format"] = "chrome";
  json negative = good;
  negative["traceEvents"][1]["dur"] = -1;
  json instant = good;
  instant["traceEvents"][1]["ph"] = "i";
  json no_ts = good;
  no_ts["traceEvents"][1].erase("ts");
  json no_clock = good;
  no_clock["otherData"].erase("clock_offset_us");
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"{\"traceEvents\": [", "parse error"},
      {"[1, 2]", "the file is not a JSON object"},
      {wrong_rank.dump(), "otherData.rank is 1, not 0"},
      {other_format.dump(), "otherData.format is not \"loom.trace\""},
      {negative.dump(), "a span's name, ts, dur or tid is not what it should be"},
      {instant.dump(), "an event's \"ph\" is \"i\", not \"X\" or \"M\""},
      {no_ts.dump(), "a span has no \"ts\""},
      {no_clock.dump(), "otherData has no \"clock_offset_us\""},
  };
  for (const auto& [text, why] : cases) {
    testing::TempDir dir;
    util::write_file_atomic(dir / "rank_0.json", text);
    const std::string error = testing::error_of<CorruptData>([&] { merge_traces(dir.path()); });
    EXPECT_TRUE(testing::contains(
        error, "trace " + (dir / "rank_0.json").string() + " is not a Loom trace: "))
        << error;
    EXPECT_TRUE(testing::contains(error, why)) << why << " in: " << error;
  }
}

}  // namespace
}  // namespace loom::cli
