// Job-wide metrics end to end: a 2-rank Trainer job under `loom run` with its metrics endpoint
// on, scraped by Debian's Prometheus server on loopback and queried over Prometheus's HTTP API;
// `promtool check metrics` on the endpoint's output; a rank made slow on purpose flagged as a
// straggler in the log, /metrics and `loom top`; a rank hung in its data source named by the
// hang watchdog with its phase, the other with its collective. The worker is
// tests/programs/train_probe.cpp.
#include <gtest/gtest.h>
#include <httplib.h>

#include <chrono>
#include <csignal>
#include <iostream>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "harness/harness.h"
#include "harness/servers.h"
#include "loom/data/dataset.h"
#include "util/files.h"
#include "util/subprocess.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using nlohmann::json;
using testing::TempDir;

const std::string kLoom = LOOM_BINARY_DIR "/tools/loom/loom";
const std::string kProbe = LOOM_BINARY_DIR "/tests/loom_train_probe";

// The value of the only sample a Prometheus query answered, or nullopt when it has none yet.
std::optional<double> only_value(const std::string& result) {
  const json r = json::parse(result);
  if (r.size() != 1) return std::nullopt;
  return std::stod(r[0]["value"][1].get<std::string>());
}

// Polls `check` every 200 ms until it holds or `timeout` passed; whether it held.
bool eventually(std::chrono::seconds timeout, const std::function<bool()>& check) {
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    if (check()) return true;
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

// A small token dataset at dir/data.
void write_tokens(const TempDir& dir) {
  data::TokenDatasetWriter writer(dir / "data", {.vocab_size = 64});
  std::mt19937 rng(7);
  for (int d = 0; d < 100; ++d) {
    std::vector<uint32_t> doc;
    for (int i = 0; i < 60; ++i) doc.push_back(static_cast<uint32_t>(rng() % 64));
    writer.add_document(doc);
  }
  writer.finish();
}

TEST(Observability, PrometheusScrapesARunningJobAndItsStragglerIsFlagged) {
  if (!LOOM_WITH_GRPC) GTEST_SKIP() << "needs `loom run` (LOOM_WITH_GRPC=ON)";
  if (std::system("command -v prometheus >/dev/null && command -v promtool >/dev/null") != 0) {
    GTEST_SKIP() << "needs Debian's prometheus (tools/install-deps.sh)";
  }
  TempDir dir;
  write_tokens(dir);

  const std::string metrics = "127.0.0.1:" + std::to_string(testing::free_port());
  testing::Prometheus prometheus({metrics});
  // Rank 1 spends 60 ms more per step in its loss (forward_backward) than rank 0; rank 0
  // waits for it in comm_wait. The job runs until the test stops it (SIGTERM).
  const fs::path output = dir / "job.out";
  util::Subprocess job = util::Subprocess::spawn(
      {.argv = {kLoom, "run", "--nproc-per-node", "2", "--run-dir", (dir / "run").string(),
                "--metrics-address", metrics, "--straggler-window", "3", "--", kProbe,
                "--probe.data=" + (dir / "data").string(), "--run.threads=1",
                "--train.steps=100000", "--train.checkpoint_every=0", "--train.log_every=100000",
                "--probe.step_ms=20", "--probe.straggler_ms=60"},
       .output = output});
  const auto job_output = [&] { return fs::exists(output) ? util::read_file(output) : ""; };

  // Prometheus has scraped the job's throughput and generation.
  std::optional<double> tokens, generation;
  ASSERT_TRUE(eventually(std::chrono::seconds(90),
                         [&] {
                           tokens = only_value(prometheus.query("loom_job_tokens_per_second"));
                           generation = only_value(prometheus.query("loom_generation"));
                           return tokens && *tokens > 0 && generation;
                         }))
      << "no tokens/s in Prometheus; job:\n"
      << job_output() << "\nprometheus:\n"
      << prometheus.log();
  EXPECT_EQ(*generation, 1);
  // 2 ranks x 8 samples x 16 tokens per step at no more than one step per 20 ms.
  EXPECT_LE(*tokens, 2 * 8 * 16 / 0.020);
  // Every rank reports, and rank 1 is flagged as the straggler, rank 0 not.
  ASSERT_TRUE(eventually(std::chrono::seconds(60), [&] {
    return only_value(prometheus.query("loom_rank_straggler{rank=\"1\"}")) == 1.0 &&
           only_value(prometheus.query("loom_rank_straggler{rank=\"0\"}")) == 0.0;
  })) << job_output();
  const auto busy0 = only_value(prometheus.query("loom_rank_busy_seconds{rank=\"0\"}"));
  const auto busy1 = only_value(prometheus.query("loom_rank_busy_seconds{rank=\"1\"}"));
  ASSERT_TRUE(busy0 && busy1);
  EXPECT_GT(*busy1, *busy0 + 0.04) << "rank 1 works 60 ms more per step";
  EXPECT_TRUE(testing::contains(job_output(), "coordinator: rank 1 is a straggler: "))
      << job_output();
  EXPECT_TRUE(testing::contains(job_output(), "most of the difference is in forward_backward"))
      << job_output();

  // The endpoint's output passes promtool's format and naming checks.
  httplib::Client http("http://" + metrics);
  const auto res = http.Get("/metrics");
  ASSERT_TRUE(res);
  util::write_file_atomic(dir / "metrics.txt", res->body);
  const auto check = testing::run_program(
      {"sh", "-c", "promtool check metrics < " + (dir / "metrics.txt").string()}, dir.path());
  EXPECT_EQ(check.exit_code, 0) << check.output << "\n" << res->body;
  EXPECT_EQ(check.output, "") << "promtool found problems";

  // `loom top` shows the same job once.
  const auto top = testing::run_program({kLoom, "top", "--once", metrics}, dir.path());
  EXPECT_EQ(top.exit_code, 0) << top.output;
  EXPECT_TRUE(testing::contains(top.output, "generation 1 running, world 2")) << top.output;
  EXPECT_TRUE(testing::contains(top.output, "straggler: rank 1")) << top.output;

  job.signal(SIGTERM);
  const auto status = job.wait_for(std::chrono::seconds(60));
  ASSERT_TRUE(status.has_value()) << "loom run did not stop on SIGTERM";
  // After the job, its run directory holds the view as it ended: `loom top RUN_DIR`.
  const auto saved = testing::run_program({kLoom, "top", (dir / "run").string()}, dir.path());
  EXPECT_EQ(saved.exit_code, 0) << saved.output;
  EXPECT_TRUE(testing::contains(saved.output, "generation 1 ")) << saved.output;
  EXPECT_TRUE(testing::contains(saved.output, "straggler: rank 1")) << saved.output;
  const auto job_metrics = json::parse(util::read_file(dir / "run" / "job_metrics.json"));
  EXPECT_EQ(job_metrics["ranks"].size(), 2u);
  EXPECT_GE(job_metrics["ranks"][1]["series"].size(), 3u);
  const auto missing = testing::run_program({kLoom, "top", dir.path().string()}, dir.path());
  EXPECT_EQ(missing.exit_code, 2) << missing.output;
  EXPECT_TRUE(testing::contains(missing.output, "no job_metrics.json in " + dir.path().string()))
      << missing.output;
}

TEST(Observability, TheHangWatchdogNamesTheRankStuckInItsDataAndTheCollectiveTheOtherWaitsIn) {
  if (!LOOM_WITH_GRPC) GTEST_SKIP() << "needs `loom run` (LOOM_WITH_GRPC=ON)";
  TempDir dir;
  write_tokens(dir);
  // Rank 1's data source blocks for good when asked for step 30's batch: a hang outside any
  // collective, which no flight recorder or collective deadline sees (the collective timeout
  // is minutes). The watchdog: 10 median steps, and at least 3 s.
  const fs::path output = dir / "job.out";
  util::Subprocess job =
      util::Subprocess::spawn({.argv = {kLoom,
                                        "run",
                                        "--nproc-per-node",
                                        "2",
                                        "--run-dir",
                                        (dir / "run").string(),
                                        "--hang-factor",
                                        "10",
                                        "--hang-min-seconds",
                                        "3",
                                        "--grace-period",
                                        "1",
                                        "--",
                                        kProbe,
                                        "--probe.data=" + (dir / "data").string(),
                                        "--run.threads=1",
                                        "--train.steps=1000",
                                        "--train.checkpoint_every=0",
                                        "--train.log_every=100000",
                                        "--probe.step_ms=20",
                                        "--probe.hang_in_data_at_step=30"},
                               .output = output});
  const auto job_output = [&] { return fs::exists(output) ? util::read_file(output) : ""; };
  const auto start = Clock::now();
  ASSERT_TRUE(eventually(std::chrono::seconds(90), [&] {
    return testing::contains(job_output(), "coordinator: hang: ");
  })) << job_output();
  const double waited = std::chrono::duration<double>(Clock::now() - start).count();
  const std::string out = job_output();
  const std::string rest = out.substr(out.find("coordinator: hang: "));
  const std::string line = rest.substr(0, rest.find('\n'));
  // Step 29 is the last one either rank finished.
  EXPECT_TRUE(testing::contains(line, "; rank 1: step 29, data_wait, in no collective")) << line;
  EXPECT_TRUE(testing::contains(line, "; rank 0: step 29, comm_wait, waiting in all_reduce #"))
      << line;
  EXPECT_TRUE(testing::contains(line, " on world (float32 x ")) << line;
  EXPECT_TRUE(testing::contains(line, "Outside collectives: rank 1 (data_wait)")) << line;
  std::cout << "hang reported " << waited << " s after the launch: " << line << "\n";
  // Every rank dumped its flight recorder on the coordinator's request; the dumps disagree
  // (rank 0 issued the all-reduce rank 1 never reached).
  ASSERT_TRUE(eventually(std::chrono::seconds(30), [&] {
    return fs::exists(dir / "run" / "flight" / "rank_0.json") &&
           fs::exists(dir / "run" / "flight" / "rank_1.json");
  })) << job_output();
  const auto diff = testing::run_program(
      {kLoom, "flight", "diff", (dir / "run" / "flight").string()}, dir.path());
  EXPECT_EQ(diff.exit_code, 1) << diff.output;
  EXPECT_TRUE(testing::contains(diff.output, "DIVERGED")) << diff.output;

  job.signal(SIGTERM);
  ASSERT_TRUE(job.wait_for(std::chrono::seconds(60)).has_value())
      << "loom run did not stop on SIGTERM";
}

}  // namespace
}  // namespace loom
