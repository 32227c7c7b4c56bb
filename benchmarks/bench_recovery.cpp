// bench_recovery: how fast a job under `loom run` is back at work after a worker is SIGKILLed,
// with in-memory snapshots every step (Loom's default) beside the same job resuming from its
// disk checkpoints alone (train.snapshot_every=0), on the GPT example (its tiny config,
// 1.3M parameters, KJV data from tools/kjv-data.sh) at W = 2 processes on this host.
//
// Each round runs both sides, in an order that alternates between rounds, and kills the same
// worker (rank 1) once rank 0 has logged the same step on both sides (a random step per round
// in [--kill-min, --kill-max]). From rank 0's metrics.jsonl (its "time" and "session" per
// step) and the time of the kill:
//   recovery/first_step   seconds from the kill to the first step the restarted job completed
//   recovery/regain       seconds from the kill until the job completed the killed step again
//                         (the restart plus the recomputation of the work lost)
//   recovery/recomputed   steps lost: the killed step minus the step resumed from
// Median and spread (max - min) over the rounds; ratio = baseline / Loom (above 1: Loom is
// better).
//
// --mode=stall: what the snapshots cost a training step, on the GPT example widened to ~20M
// parameters (8 layers, 448 wide), W = 2 under `loom run`, a snapshot every step. Three jobs
// per round, in an order that alternates: the snapshot's copy on the copy thread during the
// next forward and backward (train.checkpoint_copy=background), the whole copy just before the
// optimizer step (=optimizer_step; what =auto picks on a node whose cores all compute), and no
// snapshots. From rank 0's metrics.jsonl:
//   stall/warm        the median of the checkpoint_stall phase over the steps after the second
//   stall/cold        that phase in the second step (the first snapshot's copy: new staging)
//   stall/share       the warm stall as a share of the median step time (target: under 1%)
//   step_time         the median step time, beside the same job without snapshots (the limit)
//
//   tools/kjv-data.sh && build/benchmarks/bench_recovery            3 rounds, table
//   build/benchmarks/bench_recovery --rounds=5 --json                JSON rows
//   build/benchmarks/bench_recovery --mode=stall --rounds=2          the stall, table
#include <signal.h>
#include <sys/types.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "bench_report.h"
#include "loom/error.h"
#include "util/subprocess.h"

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

struct Settings {
  std::string loom = LOOM_BINARY_DIR "/tools/loom/loom";
  std::string gpt = LOOM_BINARY_DIR "/examples/gpt";
  std::string config = LOOM_SOURCE_DIR "/examples/gpt/configs/tiny.toml";
  std::string data = LOOM_SOURCE_DIR "/data";  // kjv-train-bpe and kjv-val-bpe
  std::string work;                            // default: $TMPDIR/loom-bench-recovery-<pid>
  int rounds = 3;
  int kill_min = 20, kill_max = 30;  // rank 0's logged step at which rank 1 is killed
  int after = 8;                     // steps trained after the killed one
  int checkpoint_every = 10;         // both sides' disk checkpoints
  bool json = false;
  std::string mode = "recovery";  // or "stall"
  int stall_steps = 12;           // --mode=stall: steps per job
};

double now_unix() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::vector<json> metrics_of(const fs::path& run) {
  std::vector<json> out;
  std::ifstream in(run / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    // The last line may be half written while the job runs.
    json j = json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!j.is_discarded()) out.push_back(std::move(j));
  }
  return out;
}

struct Outcome {
  double first_step_s = 0;
  double regain_s = 0;
  double recomputed = 0;
};

// The command line of a GPT job at W = 2 under `loom run` in a fresh `run` directory: the KJV
// data, no evaluation, sampling or log lines, then `extra` (the job's own settings).
std::vector<std::string> gpt_job(const Settings& s, const fs::path& run, int max_restarts,
                                 const std::vector<std::string>& extra) {
  fs::remove_all(run);
  fs::create_directories(run.parent_path());
  std::vector<std::string> argv = {s.loom,
                                   "run",
                                   "--nproc-per-node",
                                   "2",
                                   "--max-restarts",
                                   std::to_string(max_restarts),
                                   "--run-dir",
                                   run.string(),
                                   "--",
                                   s.gpt,
                                   "--config=" + s.config,
                                   "--run.dir=" + run.string(),
                                   "--data.train=" + s.data + "/kjv-train-bpe",
                                   "--data.val=" + s.data + "/kjv-val-bpe",
                                   "--train.eval_every=1000000",
                                   "--train.log_every=1000000",
                                   "--sample.tokens=0",
                                   "--eval.batches=1"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  return argv;
}

// One job with a kill at rank 0's step `kill_at`.
Outcome run_once(const Settings& s, bool snapshots, int kill_at, const fs::path& run) {
  const std::vector<std::string> argv = gpt_job(
      s, run, 1,
      {"--train.steps=" + std::to_string(kill_at + s.after),
       "--train.checkpoint_every=" + std::to_string(s.checkpoint_every),
       "--train.snapshot_every=" + std::string(snapshots ? "1" : "0"), "--train.warmup_steps=5"});
  auto job = loom::util::Subprocess::spawn({.argv = argv, .output = run.string() + ".out"});
  double killed_at = 0;
  for (;;) {
    const auto status = job.wait_for(std::chrono::milliseconds(20));
    LOOM_CHECK(!status, loom::Error, "the job ended before the kill: see ", run.string(), ".out");
    const std::vector<json> m = metrics_of(run);
    if (m.empty() || m.back().at("step").get<int>() < kill_at) continue;
    const std::vector<pid_t> workers = loom::util::child_pids(job.pid());
    if (workers.size() != 2) continue;
    killed_at = now_unix();
    ::kill(std::max(workers[0], workers[1]), SIGKILL);  // the later spawned: rank 1
    break;
  }
  const auto status = job.wait_for(std::chrono::minutes(10));
  LOOM_CHECK(status && status->ok(), loom::Error, "the job failed: see ", run.string(), ".out");
  const std::vector<json> m = metrics_of(run);
  const int64_t killed_session = m.front().at("session").get<int64_t>();
  int64_t killed_step = 0, resumed = -1;
  Outcome o;
  for (const json& line : m) {
    const int64_t step = line.at("step").get<int64_t>();
    const double t = line.at("time").get<double>() - killed_at;
    if (line.at("session").get<int64_t>() == killed_session) {
      killed_step = std::max(killed_step, step);
      continue;
    }
    if (resumed < 0) {
      resumed = step;
      o.first_step_s = t;
    }
    if (step >= killed_step + 1 && o.regain_s == 0) o.regain_s = t;  // the killed step, again
  }
  LOOM_CHECK(resumed >= 0, loom::Error, "no step after the restart in ", run.string());
  o.recomputed = static_cast<double>(killed_step + 1 - resumed);
  return o;
}

struct Stats {
  double median = 0, spread = 0;
};

Stats stats_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return {n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2, v.back() - v.front()};
}

loom::bench::Row row_of(const std::string& name, const Stats& loom, const Stats& baseline,
                        const std::string& baseline_name, const char* unit, int rounds) {
  return {"bench_recovery",
          name,
          loom.median,
          baseline.median,
          baseline_name,
          unit,
          loom.median > 0 ? baseline.median / loom.median : 0,
          {{"loom_spread", loom.spread},
           {"baseline_spread", baseline.spread},
           {"rounds", static_cast<double>(rounds)}}};
}

// --mode=stall: one job of `s.stall_steps` steps; "background", "at the optimizer step" or
// "none" (no snapshots). Rank 0's per-step checkpoint stall and step time, in seconds.
struct StallRun {
  std::vector<double> stall, step;
};

StallRun run_stall(const Settings& s, const std::string& copy, const fs::path& run) {
  const std::vector<std::string> argv =
      gpt_job(s, run, 0,
              {"--model.n_layer=8", "--model.n_head=7", "--model.n_embd=448",
               "--train.steps=" + std::to_string(s.stall_steps), "--train.warmup_steps=2",
               "--train.checkpoint_every=0",
               "--train.snapshot_every=" + std::string(copy == "none" ? "0" : "1"),
               "--train.checkpoint_copy=" + std::string(copy == "none" ? "auto" : copy)});
  auto job = loom::util::Subprocess::spawn({.argv = argv, .output = run.string() + ".out"});
  const auto status = job.wait_for(std::chrono::minutes(20));
  LOOM_CHECK(status && status->ok(), loom::Error, "the job failed: see ", run.string(), ".out");
  StallRun out;
  for (const json& line : metrics_of(run)) {
    out.stall.push_back(line.at("phases").at("checkpoint_stall").get<double>());
    out.step.push_back(line.at("step_seconds").get<double>());
  }
  LOOM_CHECK(static_cast<int>(out.step.size()) == s.stall_steps, loom::Error, "expected ",
             s.stall_steps, " steps in ", (run / "metrics.jsonl").string(), ", found ",
             out.step.size());
  return out;
}

int stall_mode(const Settings& s) {
  LOOM_CHECK(s.stall_steps >= 4, loom::InvalidArgument, "--stall-steps must be at least 4");
  const char* sides[] = {"background", "optimizer_step", "none"};
  // Per side: the warm stalls (steps after the second, every round), the cold ones (the second
  // step of each round) and the step times (steps after the second).
  std::vector<double> warm[3], cold[3], step[3];
  for (int round = 0; round < s.rounds; ++round) {
    for (int k = 0; k < 3; ++k) {
      const int side = (round + k) % 3;
      const StallRun r = run_stall(s, sides[side], fs::path(s.work) / "stall");
      cold[side].push_back(r.stall[1]);
      warm[side].insert(warm[side].end(), r.stall.begin() + 2, r.stall.end());
      step[side].insert(step[side].end(), r.step.begin() + 2, r.step.end());
      if (!s.json) {
        std::fprintf(stderr, "round %d, %s: median step %.3f s, warm stall %.4f s, cold %.4f s\n",
                     round, sides[side], stats_of({r.step.begin() + 2, r.step.end()}).median,
                     stats_of({r.stall.begin() + 2, r.stall.end()}).median, r.stall[1]);
      }
    }
  }
  fs::remove_all(s.work);
  const Stats step_bg = stats_of(step[0]), step_inline = stats_of(step[1]),
              step_none = stats_of(step[2]);
  const Stats warm_bg = stats_of(warm[0]), warm_inline = stats_of(warm[1]);
  const Stats cold_bg = stats_of(cold[0]), cold_inline = stats_of(cold[1]);
  const std::string inline_name = "the copy just before the optimizer step";
  auto row = [&](const std::string& name, const Stats& l, const Stats& b,
                 const std::string& baseline,
                 const char* unit) { return row_of(name, l, b, baseline, unit, s.rounds); };
  std::vector<loom::bench::Row> rows = {
      row("stall/warm/gpt_20m/W2", warm_bg, warm_inline, inline_name, "s"),
      row("stall/cold/gpt_20m/W2", cold_bg, cold_inline, inline_name, "s"),
      row("stall/share/gpt_20m/W2", {100 * warm_bg.median / step_bg.median, 0},
          {100 * warm_inline.median / step_inline.median, 0}, inline_name, "% of step"),
      row("step_time/gpt_20m/W2", step_bg, step_inline, inline_name, "s"),
      row("step_time_vs_none/gpt_20m/W2", step_bg, step_none, "no snapshots (the limit)", "s"),
  };
  if (s.json) {
    for (const auto& r : rows) loom::bench::print_json(r);
    return 0;
  }
  std::printf(
      "bench_recovery --mode=stall: GPT 8 layers x 448 (~20M parameters) at W = 2, a snapshot "
      "every step, %d steps per job, %d rounds; median (spread) over the steps after the second "
      "of every round (cold: the second step)\n",
      s.stall_steps, s.rounds);
  std::printf("%-32s %18s %18s  %s\n", "case", "loom (background)", "baseline", "ratio");
  for (const auto& r : rows) {
    std::printf("%-32s %9.4f (%6.4f) %9.4f (%6.4f)  %.2fx %s  [%s]\n", r.case_name.c_str(), r.loom,
                r.extra.at("loom_spread"), r.baseline, r.extra.at("baseline_spread"), r.ratio,
                r.unit.c_str(), r.baseline_name.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  CLI::App app{
      "Recovery of a killed worker under `loom run`: in-memory snapshots beside disk "
      "checkpoints alone, on the GPT example at W = 2."};
  app.add_option("--rounds", s.rounds, "rounds, each running both sides")->capture_default_str();
  app.add_option("--kill-min", s.kill_min, "the earliest step at which rank 1 is killed")
      ->capture_default_str();
  app.add_option("--kill-max", s.kill_max, "the latest")->capture_default_str();
  app.add_option("--after", s.after, "steps trained after the killed one")->capture_default_str();
  app.add_option("--checkpoint-every", s.checkpoint_every, "disk checkpoints, both sides")
      ->capture_default_str();
  app.add_option("--data", s.data, "the directory with kjv-train-bpe and kjv-val-bpe")
      ->capture_default_str();
  app.add_option("--config", s.config, "the GPT config")->capture_default_str();
  app.add_option("--work-dir", s.work, "where the runs go");
  app.add_flag("--json", s.json, "one JSON object per row");
  app.add_option("--mode", s.mode,
                 "recovery (time back at work after a kill) or stall (the snapshots' cost per "
                 "step)")
      ->check(CLI::IsMember({"recovery", "stall"}))
      ->capture_default_str();
  app.add_option("--stall-steps", s.stall_steps, "--mode=stall: steps per job")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    LOOM_CHECK(fs::exists(fs::path(s.data) / "kjv-val-bpe" / "manifest.json"),
               loom::InvalidArgument, "no KJV datasets in ", s.data,
               ": run tools/kjv-data.sh first (or pass --data)");
    if (s.work.empty()) {
      s.work = (fs::temp_directory_path() / ("loom-bench-recovery-" + std::to_string(::getpid())))
                   .string();
    }
    if (s.mode == "stall") return stall_mode(s);
    std::mt19937 rng(7);
    std::vector<double> first[2], regain[2], recomputed[2];  // [0] Loom, [1] baseline
    for (int round = 0; round < s.rounds; ++round) {
      const int kill_at = s.kill_min + static_cast<int>(rng() % (s.kill_max - s.kill_min + 1));
      for (int k = 0; k < 2; ++k) {
        const int side = (round + k) % 2;  // alternate which side runs first
        const Outcome o = run_once(s, side == 0, kill_at, fs::path(s.work) / "run");
        first[side].push_back(o.first_step_s);
        regain[side].push_back(o.regain_s);
        recomputed[side].push_back(o.recomputed);
        if (!s.json) {
          std::fprintf(stderr,
                       "round %d, %s: killed at step %d: first step after %.2f s, back "
                       "at the killed step after %.2f s, %.0f steps recomputed\n",
                       round, side == 0 ? "snapshots" : "disk only", kill_at, o.first_step_s,
                       o.regain_s, o.recomputed);
        }
      }
    }
    fs::remove_all(s.work);
    const std::string baseline =
        "disk checkpoints every " + std::to_string(s.checkpoint_every) + " steps, no snapshots";
    std::vector<loom::bench::Row> rows;
    auto add = [&](const std::string& name, const std::vector<double>* values, const char* unit) {
      rows.push_back(
          row_of(name, stats_of(values[0]), stats_of(values[1]), baseline, unit, s.rounds));
    };
    add("recovery/first_step/gpt_tiny/W2", first, "s");
    add("recovery/regain/gpt_tiny/W2", regain, "s");
    add("recovery/recomputed/gpt_tiny/W2", recomputed, "steps");
    if (s.json) {
      for (const auto& r : rows) loom::bench::print_json(r);
    } else {
      std::printf(
          "bench_recovery: GPT tiny at W = 2, rank 1 SIGKILLed at a step in [%d, %d], "
          "%d rounds, median (spread)\n",
          s.kill_min, s.kill_max, s.rounds);
      std::printf("%-36s %16s %16s  %s\n", "case", "loom (snapshots)", "baseline", "ratio");
      for (const auto& r : rows) {
        std::printf("%-36s %9.2f (%4.2f) %9.2f (%4.2f)  %.2fx %s\n", r.case_name.c_str(), r.loom,
                    r.extra.at("loom_spread"), r.baseline, r.extra.at("baseline_spread"), r.ratio,
                    r.unit.c_str());
      }
      std::printf("baseline: %s\n", baseline.c_str());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_recovery: %s\n", e.what());
    return 1;
  }
  return 0;
}
