// `loom top`'s view (tools/loom/top_view.h) of a fixed /api/metrics answer, compared whole.
// The answer's format is JobMetrics::json (control/job_metrics.h); the view of a live job is
// checked in tests/integration/observability_test.cpp.
#include "top_view.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "harness/harness.h"
#include "loom/error.h"

namespace loom::cli {
namespace {

using nlohmann::json;

json point(int64_t generation, int64_t step, double busy, double wait, std::optional<double> mfu) {
  return {{"unix_time", 1000.0},
          {"generation", generation},
          {"steps", 2},
          {"last_step", step},
          {"step_seconds", busy + wait},
          {"busy_seconds", busy},
          {"phase_seconds",
           {{"data_wait", 0.0625}, {"forward_backward", busy - 0.0625}, {"comm_wait", wait}}},
          {"tokens_per_second", 1536.0},
          {"samples_per_second", 12.0},
          {"mfu", mfu ? json(*mfu) : json(nullptr)},
          {"rss_bytes", 3 << 20},
          {"loss", 2.5},
          {"goodput", 0.875}};
}

TEST(TopView, RendersTheJobTheRanksOfTheCurrentGenerationAndTheStragglers) {
  const json answer = {
      {"job",
       {{"generation", 2},
        {"state", "running"},
        {"world_size", 2},
        {"restarts", 1},
        {"last_failure", "rank 1 exited with code 9"},
        {"hang", "no rank has finished a step for 75.0 s (...)"}}},
      {"summary",
       {{"ranks", 2},
        {"tokens_per_second", 3072.0},
        {"samples_per_second", 24.0},
        {"step_seconds", 0.75},
        {"mfu", 0.25},
        {"goodput", 0.875},
        {"loss", 2.5}}},
      {"ranks",
       {{{"rank", 0},
         {"series", {point(1, 3, 0.25, 0.0, 0.5), point(2, 41, 0.25, 0.5, 0.25)}},
         {"heartbeat_age_seconds", 0.5}},
        {{"rank", 1}, {"series", {point(2, 41, 0.75, 0.0, std::nullopt)}}},
        {{"rank", 2}, {"series", {point(1, 3, 0.25, 0.0, 0.5)}}}}},  // gone since generation 1
      {"stragglers",
       {{{"rank", 1},
         {"busy_seconds", 0.75},
         {"others_seconds", 0.25},
         {"ratio", 3.0},
         {"phase", "forward_backward"},
         {"phase_excess_seconds", 0.5}}}},
      {"generations", json::array()}};
  EXPECT_EQ(render_top(answer.dump()),
            "generation 2 running, world 2, restarts 1 | 3072 tokens/s | step 0.750 s | "
            "MFU 25.0% | goodput 87.5% | loss 2.5000\n"
            "HUNG: no rank has finished a step for 75.0 s (...)\n"
            "last failure: rank 1 exited with code 9\n"
            "rank     step  step_s  busy_s    data fwd_bwd    comm   optim    ckpt   tokens/s    "
            "mfu  rss_MiB\n"
            "   0       41   0.750   0.250   0.062   0.188   0.500   0.000   0.000       1536  "
            "25.0%      3.0\n"
            "   1       41   0.750   0.750   0.062   0.688   0.000   0.000   0.000       1536      "
            "-      3.0  << straggler\n"
            "straggler: rank 1, 3.00x the other ranks' time outside collective waits, most in "
            "forward_backward (+0.500 s)\n");
}

TEST(TopView, AJobWithoutStepsYetSaysSo) {
  const json answer = {{"job",
                        {{"generation", 0},
                         {"state", "gathering"},
                         {"world_size", 0},
                         {"restarts", 0},
                         {"last_failure", ""}}},
                       {"summary",
                        {{"ranks", 0},
                         {"tokens_per_second", 0.0},
                         {"samples_per_second", 0.0},
                         {"step_seconds", 0.0},
                         {"mfu", nullptr},
                         {"goodput", nullptr},
                         {"loss", nullptr}}},
                       {"ranks", json::array()},
                       {"stragglers", json::array()}};
  EXPECT_EQ(render_top(answer.dump()),
            "generation 0 gathering, world 0, restarts 0\n"
            "no step reported in this generation yet\n");
}

TEST(TopView, AJobSpecsServicesAreListedWithTheirStateAndRestarts) {
  const auto service = [](const char* name, int replica, const char* state, int pid, int restarts,
                          const char* last_exit) {
    return json{{"service", name},
                {"replica", replica},
                {"node", 0},
                {"pid", pid},
                {"state", state},
                {"restarts", restarts},
                {"last_exit", last_exit}};
  };
  const json answer = {{"job",
                        {{"generation", 1},
                         {"state", "gathering"},
                         {"world_size", 2},
                         {"restarts", 0},
                         {"last_failure", ""}}},
                       {"summary",
                        {{"ranks", 0},
                         {"tokens_per_second", 0.0},
                         {"samples_per_second", 0.0},
                         {"step_seconds", 0.0},
                         {"mfu", nullptr},
                         {"goodput", nullptr},
                         {"loss", nullptr}}},
                       {"ranks", json::array()},
                       {"stragglers", json::array()},
                       {"services",
                        {service("data", 0, "running", 4242, 1, "killed by signal 9 (Killed)"),
                         service("eval", 0, "restarting", 0, 2, "exited with code 1")}}};
  EXPECT_EQ(render_top(answer.dump()),
            "generation 1 gathering, world 2, restarts 0\n"
            "no step reported in this generation yet\n"
            "service          node state             pid restarts  last exit\n"
            "data/0              0 running          4242        1  killed by signal 9 (Killed)\n"
            "eval/0              0 restarting          0        2  exited with code 1\n");
}

TEST(TopView, AnotherAnswerIsAClearError) {
  auto message = testing::error_of<InvalidArgument>([] { render_top("<html>404</html>"); });
  EXPECT_NE(message.find("not the coordinator's /api/metrics answer"), std::string::npos)
      << message;
  message = testing::error_of<InvalidArgument>(
      [] { render_top(R"({"job": {}, "summary": {}, "ranks": [], "stragglers": []})"); });
  EXPECT_NE(message.find("lacks a field"), std::string::npos) << message;
}

}  // namespace
}  // namespace loom::cli
