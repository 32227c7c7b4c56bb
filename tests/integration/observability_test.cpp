// Job-wide metrics end to end: a 2-rank Trainer job under `loom run` with its metrics endpoint
// on, scraped by Debian's Prometheus server on loopback and queried over Prometheus's HTTP API;
// `promtool check metrics` on the endpoint's output; a rank made slow on purpose flagged as a
// straggler in the log, /metrics and `loom top`; a rank hung in its data source named by the
// hang watchdog with its phase, the other with its collective; the merged trace of chosen
// steps. The worker is tests/programs/train_probe.cpp.
#include <gtest/gtest.h>
#include <httplib.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
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
  // Every rank wrote its threads' stacks beside: its named threads, the data-blocked rank's
  // training thread asleep in its source's wait.
  ASSERT_TRUE(eventually(std::chrono::seconds(30), [&] {
    return fs::exists(dir / "run" / "stacks" / "rank_0.txt") &&
           fs::exists(dir / "run" / "stacks" / "rank_1.txt");
  })) << job_output();
  for (int rank : {0, 1}) {
    const std::string stacks =
        util::read_file(dir / "run" / "stacks" / ("rank_" + std::to_string(rank) + ".txt"));
    for (const char* thread : {"\"comm world\"", "\"comm control\"", "\"loom_train_prob\""}) {
      EXPECT_TRUE(testing::contains(stacks, thread)) << rank << " " << thread << "\n" << stacks;
    }
    EXPECT_TRUE(testing::contains(stacks, "(this thread, taking the dump)")) << stacks;
    if (rank == 1) std::cout << "rank 1's stacks:\n" << stacks.substr(0, 3000) << "\n";
  }
  const auto diff = testing::run_program(
      {kLoom, "flight", "diff", (dir / "run" / "flight").string()}, dir.path());
  EXPECT_EQ(diff.exit_code, 1) << diff.output;
  EXPECT_TRUE(testing::contains(diff.output, "DIVERGED")) << diff.output;

  job.signal(SIGTERM);
  ASSERT_TRUE(job.wait_for(std::chrono::seconds(60)).has_value())
      << "loom run did not stop on SIGTERM";
}

// The Chrome trace-event format as Perfetto's JSON importer reads it, checked field by field:
// every event an object with exactly the known keys; spans ("X") with a name, a category, a
// start and a duration in microseconds, a process and a thread; metadata ("M") naming a
// process or thread or ordering processes.
void expect_trace_event_format(const json& trace) {
  ASSERT_TRUE(trace.is_object());
  ASSERT_TRUE(trace.contains("traceEvents") && trace["traceEvents"].is_array());
  EXPECT_EQ(trace["displayTimeUnit"], "ms");
  for (const auto& [key, value] : trace.items()) {
    EXPECT_TRUE(key == "traceEvents" || key == "displayTimeUnit" || key == "otherData") << key;
  }
  for (const json& e : trace["traceEvents"]) {
    ASSERT_TRUE(e.is_object()) << e;
    for (const auto& [key, value] : e.items()) {
      EXPECT_TRUE(key == "name" || key == "cat" || key == "ph" || key == "ts" || key == "dur" ||
                  key == "pid" || key == "tid" || key == "args")
          << "unknown key " << key << " in " << e;
    }
    ASSERT_TRUE(e["name"].is_string() && !e["name"].get<std::string>().empty()) << e;
    ASSERT_TRUE(e["pid"].is_number_integer() && e["pid"] >= 0) << e;
    ASSERT_TRUE(e["tid"].is_number_integer() && e["tid"] >= 0) << e;
    if (e.contains("args")) {
      ASSERT_TRUE(e["args"].is_object()) << e;
    }
    if (e["ph"] == "X") {
      ASSERT_TRUE(e["cat"].is_string()) << e;
      ASSERT_TRUE(e["ts"].is_number() && e["ts"] >= 0) << e;
      ASSERT_TRUE(e["dur"].is_number() && e["dur"] >= 0) << e;
    } else {
      ASSERT_EQ(e["ph"], "M") << e;
      const std::string name = e["name"];
      if (name == "process_sort_index") {
        ASSERT_TRUE(e["args"]["sort_index"].is_number_integer()) << e;
      } else {
        ASSERT_TRUE(name == "process_name" || name == "thread_name") << e;
        ASSERT_TRUE(e["args"]["name"].is_string()) << e;
      }
    }
  }
}

TEST(Observability, TheMergedTraceOfATwoRankJobHoldsEveryRanksCollectivesInStep) {
  if (!LOOM_WITH_GRPC) GTEST_SKIP() << "needs `loom run` (LOOM_WITH_GRPC=ON)";
  TempDir dir;
  write_tokens(dir);
  // Steps 3, 4 and 5 traced; the checkpoint of step 4 is saved after step 3 (the 4th).
  const auto run = testing::run_program(
      {kLoom, "run", "--nproc-per-node", "2", "--run-dir", (dir / "run").string(), "--", kProbe,
       "--probe.data=" + (dir / "data").string(), "--run.threads=1", "--train.steps=8",
       "--train.checkpoint_every=4", "--train.log_every=100000", "--probe.step_ms=5",
       "--metrics.trace_steps=3-5"},
      dir.path());
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const auto merge = testing::run_program({kLoom, "trace", (dir / "run").string()}, dir.path());
  ASSERT_EQ(merge.exit_code, 0) << merge.output;
  const fs::path merged_file = dir / "run" / "traces" / "job.json";
  EXPECT_TRUE(testing::contains(merge.output, "merged 2 ranks, ")) << merge.output;
  EXPECT_TRUE(testing::contains(merge.output, " into " + merged_file.string())) << merge.output;
  EXPECT_TRUE(testing::contains(merge.output, "rank 1's clock: ")) << merge.output;
  std::cout << merge.output;

  const json trace = json::parse(util::read_file(merged_file));
  expect_trace_event_format(trace);
  if (HasFatalFailure()) return;
  EXPECT_EQ(trace["otherData"]["ranks"], json::array({0, 1}));
  EXPECT_EQ(trace["otherData"]["steps"], json::array({3, 4, 5}));
  const double uncertainty = trace["otherData"]["clock_uncertainties_us"][1];
  EXPECT_LT(uncertainty, 50'000);

  // Per rank: its thread names, steps, phases, collectives and checkpoint spans.
  struct Span {
    std::string name, cat;
    double ts, end;
    int tid;
    json args;
  };
  std::map<int, std::map<int, std::string>> threads;
  std::map<int, std::vector<Span>> spans;
  for (const json& e : trace["traceEvents"]) {
    if (e["ph"] == "M" && e["name"] == "thread_name")
      threads[e["pid"]][e["tid"]] = e["args"]["name"];
    if (e["ph"] != "X") continue;
    spans[e["pid"]].push_back({e["name"], e["cat"], e["ts"].get<double>(),
                               e["ts"].get<double>() + e["dur"].get<double>(), e["tid"],
                               e.value("args", json::object())});
  }
  ASSERT_EQ(spans.size(), 2u);
  // (group, sequence) -> (op, bytes, start, end) on each rank.
  std::map<int, std::map<std::pair<std::string, int64_t>, Span>> collectives;
  for (int rank : {0, 1}) {
    std::vector<Span> steps;
    for (const Span& s : spans[rank]) {
      if (s.cat == "step") steps.push_back(s);
      if (s.cat == "collective") {
        EXPECT_EQ(threads[rank][s.tid], "comm " + s.args["group"].get<std::string>()) << s.name;
        EXPECT_TRUE(s.args["bytes"].is_number_integer() && s.args["bytes"] >= 0) << s.args;
        EXPECT_EQ(s.args["peers"], json::array()) << s.args;
        const auto key =
            std::make_pair(s.args["group"].get<std::string>(), s.args["sequence"].get<int64_t>());
        EXPECT_EQ(collectives[rank].count(key), 0u) << "twice: " << s.name << " " << s.args;
        collectives[rank][key] = s;
      }
    }
    // Three steps, in order, one after the other, on one (the training) thread.
    ASSERT_EQ(steps.size(), 3u) << rank;
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(steps[i].name, "step " + std::to_string(3 + i));
      EXPECT_EQ(steps[i].args, json({{"step", 3 + i}}));
      EXPECT_EQ(steps[i].tid, steps[0].tid);
      if (i > 0) {
        EXPECT_GE(steps[i].ts, steps[i - 1].end);
      }
    }
    // Every phase, forward and backward lies inside a step on the training thread; each step
    // has its data wait, forward, backward, communication wait and optimizer.
    for (const Span& step : steps) {
      std::multiset<std::string> inside;
      for (const Span& s : spans[rank]) {
        if ((s.cat == "phase" || s.cat == "train") && s.ts >= step.ts && s.end <= step.end) {
          EXPECT_EQ(s.tid, step.tid) << s.name;
          inside.insert(s.name);
        }
      }
      for (const char* name :
           {"data_wait", "forward_backward", "forward", "backward", "comm_wait", "optimizer"}) {
        EXPECT_GE(inside.count(name), 1u) << rank << " " << step.name << ": " << name;
      }
    }
    // Step 4's checkpoint: its copy, write and commit, the write on the checkpoint's thread.
    std::set<std::string> saved;
    for (const Span& s : spans[rank]) {
      if (s.cat == "checkpoint" && s.args == json({{"step", 4}})) {
        saved.insert(s.name);
        if (s.name == "checkpoint write") {
          EXPECT_EQ(threads[rank][s.tid], "ckpt writer");
        }
      }
    }
    EXPECT_EQ(saved,
              (std::set<std::string>{"checkpoint copy", "checkpoint write", "checkpoint commit"}))
        << rank;
  }
  // Both ranks ran the same collectives: per group, consecutive sequence numbers with the same
  // op and bytes on each, and each one's time on one rank overlaps its time on the other (a
  // collective cannot end on one rank before it began on the other), within the clocks'
  // uncertainty.
  ASSERT_FALSE(collectives[0].empty());
  ASSERT_EQ(collectives[0].size(), collectives[1].size());
  std::map<std::string, int64_t> previous;
  for (const auto& [key, a] : collectives[0]) {
    ASSERT_EQ(collectives[1].count(key), 1u) << key.first << " #" << key.second;
    const Span& b = collectives[1].at(key);
    EXPECT_EQ(a.name, b.name) << key.first << " #" << key.second;
    EXPECT_EQ(a.args, b.args) << key.first << " #" << key.second;
    EXPECT_LE(a.ts, b.end + uncertainty + 1) << a.name << " #" << key.second;
    EXPECT_LE(b.ts, a.end + uncertainty + 1) << a.name << " #" << key.second;
    if (previous.count(key.first) != 0) {
      EXPECT_EQ(key.second, previous[key.first] + 1);
    }
    previous[key.first] = key.second;
  }
  EXPECT_EQ(previous.count("world"), 1u);
  EXPECT_EQ(previous.count("control"), 1u);
}

// What the dashboard page drew, read from its DOM: the header, each chart's series (name and
// points) and restart markers, the straggler rows, the ranks, the step breakdown's bars and the
// file links.
constexpr const char* kReadDashboard = R"JS(
  const charts = {};
  for (const svg of document.querySelectorAll('svg.chart')) {
    charts[svg.id] = {
      series: Object.fromEntries([...svg.querySelectorAll('polyline.series')]
                                 .map(p => [p.dataset.series, Number(p.dataset.points)])),
      restarts: [...svg.querySelectorAll('line.restart')].map(l => Number(l.dataset.generation))};
  }
  return {
    state: document.getElementById('job-state').textContent,
    charts,
    stragglers: [...document.querySelectorAll('#stragglers tbody tr')]
                    .map(tr => [Number(tr.dataset.rank), tr.children[4].textContent]),
    ranks: [...document.querySelectorAll('#ranks tbody tr')].map(tr => Number(tr.dataset.rank)),
    bars: [...document.querySelectorAll('#breakdown .seg')]
              .map(s => Number(s.dataset.rank) + ':' + s.dataset.phase),
    files: [...document.querySelectorAll('#files a')].map(a => a.dataset.path)};
)JS";

// Where the dashboard tests save their screenshots (kept after the test; docs/observability.md
// shows them).
const fs::path kScreenshots = LOOM_BINARY_DIR "/test-artifacts/dashboard";

// The GET of `path` from host:port; nullopt when nothing answered.
std::optional<httplib::Result> http_get(const std::string& address, const std::string& path,
                                        const httplib::Headers& headers = {}) {
  httplib::Client client("http://" + address);
  client.set_connection_timeout(std::chrono::seconds(2));
  auto res = client.Get(path, headers);
  if (!res) return std::nullopt;
  return res;
}

TEST(Observability, TheDashboardShowsARunningJobsRestartAndStragglerAndAFinishedRunsSeries) {
  if (!LOOM_WITH_GRPC) GTEST_SKIP() << "needs `loom run` (LOOM_WITH_GRPC=ON)";
  if (!testing::Browser::available()) {
    GTEST_SKIP() << "needs Debian's chromium and chromium-driver (tools/install-deps.sh)";
  }
  TempDir dir;
  write_tokens(dir);
  const std::string metrics = "127.0.0.1:" + std::to_string(testing::free_port());
  // Rank 1 is 60 ms slower per step, and SIGKILLs itself at step 15 of generation 1; the job
  // restarts once, from its in-memory snapshot. Steps 3-4 are traced (files to link).
  const fs::path output = dir / "job.out";
  util::Subprocess job =
      util::Subprocess::spawn({.argv = {kLoom,
                                        "run",
                                        "--nproc-per-node",
                                        "2",
                                        "--run-dir",
                                        (dir / "run").string(),
                                        "--metrics-address",
                                        metrics,
                                        "--straggler-window",
                                        "3",
                                        "--max-restarts",
                                        "1",
                                        "--",
                                        kProbe,
                                        "--probe.data=" + (dir / "data").string(),
                                        "--run.threads=1",
                                        "--train.steps=100000",
                                        "--train.checkpoint_every=0",
                                        "--train.log_every=100000",
                                        "--probe.step_ms=20",
                                        "--probe.straggler_ms=60",
                                        "--probe.kill_at_step=15",
                                        "--metrics.trace_steps=3-4"},
                               .output = output});
  const auto job_output = [&] { return fs::exists(output) ? util::read_file(output) : ""; };
  // Generation 2 is running, has reported, and rank 1 is flagged again.
  ASSERT_TRUE(eventually(std::chrono::seconds(120), [&] {
    const auto res = http_get(metrics, "/api/metrics");
    if (!res || (*res)->status != 200) return false;
    const json m = json::parse((*res)->body);
    bool slow = false;
    for (const json& s : m["stragglers"]) slow |= s["rank"] == 1;
    size_t fresh = 0;
    for (const json& r : m["ranks"]) {
      for (const json& p : r["series"]) fresh += p["generation"] == 2 ? 1 : 0;
    }
    return m["job"]["generation"] == 2 && m["job"]["state"] == "running" && slow && fresh >= 4;
  })) << job_output();

  testing::Browser browser;
  browser.open("http://" + metrics + "/");
  ASSERT_TRUE(browser.wait_for("document.body.dataset.ready === '1'", std::chrono::seconds(30)))
      << browser.run("return document.body.innerText;");
  const json live = json::parse(browser.run(kReadDashboard));
  browser.screenshot(kScreenshots / "running_job.png");
  EXPECT_EQ(live["state"], "generation 2 running") << live.dump(1);
  for (const char* chart : {"chart-tokens", "chart-step", "chart-memory"}) {
    for (const char* rank : {"rank 0", "rank 1"}) {
      EXPECT_GE(live["charts"][chart]["series"].value(rank, 0), 1) << chart << " " << rank;
    }
  }
  for (const char* chart :
       {"chart-tokens", "chart-mfu", "chart-step", "chart-memory", "chart-goodput"}) {
    EXPECT_EQ(live["charts"][chart]["restarts"], json::array({2})) << chart;
  }
  EXPECT_EQ(live["stragglers"], json::array({json::array({1, "forward_backward"})}));
  EXPECT_EQ(live["ranks"], json::array({0, 1}));
  EXPECT_EQ(live["bars"].size(), 12u) << "6 phases x 2 ranks";
  for (const char* file : {"traces/rank_0.json", "traces/rank_1.json"}) {
    EXPECT_NE(std::find(live["files"].begin(), live["files"].end(), file), live["files"].end())
        << file << " in " << live["files"];
  }

  job.signal(SIGTERM);
  ASSERT_TRUE(job.wait_for(std::chrono::seconds(60)).has_value()) << job_output();

  // After the job: `loom dash RUN_DIR` draws exactly the saved series.
  const std::string address = "127.0.0.1:" + std::to_string(testing::free_port());
  util::Subprocess dash = util::Subprocess::spawn(
      {.argv = {kLoom, "dash", (dir / "run").string(), "--address", address},
       .output = dir / "dash.out"});
  ASSERT_TRUE(eventually(std::chrono::seconds(30), [&] {
    return http_get(address, "/").has_value();
  })) << util::read_file(dir / "dash.out");
  browser.open("http://" + address + "/");
  ASSERT_TRUE(browser.wait_for("document.body.dataset.ready === '1'", std::chrono::seconds(30)));
  const json after = json::parse(browser.run(kReadDashboard));
  browser.screenshot(kScreenshots / "finished_run.png");
  const json saved = json::parse(util::read_file(dir / "run" / "job_metrics.json"));
  EXPECT_EQ(after["state"], "generation " + std::to_string(saved["job"]["generation"].get<int>()) +
                                " " + saved["job"]["state"].get<std::string>());
  for (const json& r : saved["ranks"]) {
    const std::string name = "rank " + std::to_string(r["rank"].get<int>());
    size_t with_mfu = 0;
    for (const json& p : r["series"]) with_mfu += p["mfu"].is_null() ? 0 : 1;
    EXPECT_EQ(after["charts"]["chart-tokens"]["series"][name], r["series"].size()) << name;
    EXPECT_EQ(after["charts"]["chart-step"]["series"][name], r["series"].size()) << name;
    EXPECT_EQ(after["charts"]["chart-memory"]["series"][name], r["series"].size()) << name;
    EXPECT_EQ(after["charts"]["chart-mfu"]["series"][name], with_mfu) << name;
  }
  EXPECT_EQ(after["charts"]["chart-tokens"]["restarts"], json::array({2}));
  json rows = json::array();
  for (const json& s : saved["stragglers"]) rows.push_back({s["rank"], s["phase"]});
  EXPECT_EQ(after["stragglers"], rows);
  // Every trace, flight dump and stack dump of the run is linked, and nothing else.
  std::vector<std::string> expected;
  for (const auto& entry : fs::recursive_directory_iterator(dir / "run")) {
    const std::string rel = fs::relative(entry.path(), dir / "run").string();
    if ((entry.path().extension() == ".json" &&
         (rel.rfind("traces/", 0) == 0 || rel.rfind("flight/", 0) == 0)) ||
        (entry.path().extension() == ".txt" && rel.rfind("stacks/", 0) == 0)) {
      expected.push_back(rel);
    }
  }
  std::sort(expected.begin(), expected.end());
  std::vector<std::string> linked = after["files"];
  std::sort(linked.begin(), linked.end());
  EXPECT_EQ(linked, expected);
  EXPECT_GE(expected.size(), 3u) << "two traces and at least one flight dump (the kill)";

  // It serves the linked files, and nothing outside them.
  const auto trace0 = http_get(address, "/files/traces/rank_0.json");
  ASSERT_TRUE(trace0);
  EXPECT_EQ((*trace0)->status, 200);
  EXPECT_EQ((*trace0)->body, util::read_file(dir / "run" / "traces" / "rank_0.json"));
  for (const char* outside : {"/files/../job_metrics.json", "/files/traces/../job_metrics.json",
                              "/files/job_metrics.json", "/files/traces/missing.json",
                              "/files/ckpt/step_00000000/manifest.json"}) {
    const auto res = http_get(address, outside);
    ASSERT_TRUE(res) << outside;
    EXPECT_EQ((*res)->status, 404) << outside;
  }
  dash.signal(SIGTERM);
  const auto dash_status = dash.wait_for(std::chrono::seconds(10));
  ASSERT_TRUE(dash_status.has_value());
  EXPECT_TRUE(dash_status->ok()) << dash_status->describe();

  // Beyond loopback it needs --public and a token, and then every request must carry it.
  const std::string any = "0.0.0.0:" + std::to_string(testing::free_port());
  const auto refused =
      testing::run_program({kLoom, "dash", (dir / "run").string(), "--address", any}, dir.path());
  EXPECT_EQ(refused.exit_code, 2) << refused.output;
  EXPECT_TRUE(testing::contains(refused.output,
                                "beyond loopback: that needs --public and a token "
                                "in LOOM_JOB_TOKEN"))
      << refused.output;
  util::Subprocess open_dash = util::Subprocess::spawn(
      {.argv = {kLoom, "dash", (dir / "run").string(), "--address", any, "--public"},
       .env = {{"LOOM_JOB_TOKEN", "s3cret"}},
       .output = dir / "public.out"});
  const std::string local = "127.0.0.1" + any.substr(any.find(':'));
  ASSERT_TRUE(eventually(std::chrono::seconds(30), [&] {
    return http_get(local, "/").has_value();
  })) << util::read_file(dir / "public.out");
  EXPECT_EQ((*http_get(local, "/api/metrics"))->status, 401);
  EXPECT_EQ((*http_get(local, "/api/metrics", {{"Authorization", "Bearer wrong"}}))->status, 401);
  const auto allowed = http_get(local, "/api/metrics", {{"Authorization", "Bearer s3cret"}});
  EXPECT_EQ((*allowed)->status, 200);
  EXPECT_EQ(json::parse((*allowed)->body), saved);
  std::cout << "screenshots in " << kScreenshots << "\n";
}

}  // namespace
}  // namespace loom
