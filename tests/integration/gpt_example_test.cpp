// The GPT example as a user runs it: parallel.mode from the command line (DDP, ZeRO-1, ZeRO-2
// and FSDP train alike, bitwise at one rank, with activation checkpointing too; FSDP at two
// ranks as DDP does), and the result is the held-out loss at the last step even when
// train.steps is not a multiple of train.eval_every.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "harness/harness.h"
#include "harness/servers.h"
#include "loom/error.h"
#include "util/files.h"
#include "util/subprocess.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using testing::run_loom;
using testing::TempDir;

// As the example logs it: four decimals.
std::string fmt_loss(double loss) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.4f", loss);
  return text;
}

class GptExample : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(kGpt)) GTEST_SKIP() << kGpt << " not built (LOOM_BUILD_EXAMPLES=OFF)";
    const fs::path text = dir_ / "genesis.txt";
    ASSERT_TRUE(util::Subprocess::spawn({.argv = {"bible", "gen1:1-gen10:32"}, .output = text})
                    .wait()
                    .ok());
    dataset_ = (dir_ / "kjv").string();
    const auto built = run_loom(dir_, {"data", "build", "text", "--input", text.string(),
                                       "--vocab-size", "300", "--out", dataset_});
    ASSERT_EQ(built.exit_code, 0) << built.output;
  }

  testing::ProgramResult train(const std::string& name, const std::vector<std::string>& extra) {
    std::vector<std::string> argv = gpt_argv(extra);
    argv.push_back("--run.dir=" + (dir_ / name).string());
    return testing::run_program(argv, dir_.path());
  }

  // The same on `ranks` processes under `loom run` (its run directory becomes run.dir).
  testing::ProgramResult train_ranks(const std::string& name, int ranks,
                                     const std::vector<std::string>& extra) {
    std::vector<std::string> argv = {
        "run", "--run-dir", (dir_ / name).string(), "--nproc-per-node", std::to_string(ranks),
        "--"};
    const std::vector<std::string> program = gpt_argv(extra);
    argv.insert(argv.end(), program.begin(), program.end());
    return run_loom(dir_, argv);
  }

  std::vector<std::string> gpt_argv(const std::vector<std::string>& extra) const {
    std::vector<std::string> argv = {kGpt,
                                     "--data.train=" + dataset_,
                                     "--data.val=" + dataset_,
                                     "--model.n_layer=2",
                                     "--model.n_head=2",
                                     "--model.n_embd=16",
                                     "--model.seq_len=16",
                                     "--train.batch_size=4",
                                     "--train.steps=5",
                                     "--train.eval_every=2",
                                     "--eval.batches=1",
                                     "--sample.tokens=2",
                                     "--train.log_every=1"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return argv;
  }

  // Every step's loss rank 0 logged, by step.
  std::map<int64_t, double> losses(const std::string& name) const {
    std::map<int64_t, double> out;
    std::ifstream in(dir_ / name / "metrics.jsonl");
    for (std::string line; std::getline(in, line);) {
      const json j = json::parse(line);
      if (j.contains("loss") && j.contains("step")) out[j["step"]] = j["loss"].get<double>();
    }
    return out;
  }

  json result(const std::string& name) const {
    std::ifstream in(dir_ / name / "result.json");
    return json::parse(in);
  }

  const std::string kGpt = LOOM_BINARY_DIR "/examples/gpt";
  TempDir dir_;
  std::string dataset_;
};

TEST_F(GptExample, EveryParallelModeTrainsTheSameAtOneRank) {
  const auto ddp = train("ddp", {});
  ASSERT_EQ(ddp.exit_code, 0) << ddp.output;
  const auto reference = losses("ddp");
  ASSERT_EQ(reference.size(), 5u);
  for (const std::string mode : {"zero1", "zero2", "fsdp"}) {
    const auto run = train(mode, {"--parallel.mode=" + mode, "--parallel.bucket_mb=0.01"});
    ASSERT_EQ(run.exit_code, 0) << run.output;
    EXPECT_EQ(losses(mode), reference) << mode;  // bitwise: one rank, the same arithmetic
  }
  // Activation checkpointing recomputes each block in backward: the same gradients, bitwise.
  for (const std::string mode : {"ddp", "fsdp"}) {
    const std::string name = mode + "_ac";
    const auto run =
        train(name, {"--parallel.mode=" + mode, "--train.activation_checkpointing=true"});
    ASSERT_EQ(run.exit_code, 0) << run.output;
    EXPECT_EQ(losses(name), reference) << name;
  }
  // FSDP's mixed-precision policy from config: bf16 compute on fp32 masters. bf16 keeps 8 bits
  // of mantissa; each step's loss is within 0.5% of the fp32 run's (measured: at most 1.4e-4
  // relative over the 5 steps, and never equal).
  const auto bf16 = train("fsdp_bf16", {"--parallel.mode=fsdp", "--parallel.param_dtype=bf16"});
  ASSERT_EQ(bf16.exit_code, 0) << bf16.output;
  const auto bf16_losses = losses("fsdp_bf16");
  ASSERT_EQ(bf16_losses.size(), reference.size());
  for (const auto& [step, loss] : reference) {
    EXPECT_NEAR(bf16_losses.at(step), loss, 5e-3 * loss) << "step " << step;
    EXPECT_NE(bf16_losses.at(step), loss) << "step " << step << ": bf16 compute changed nothing";
  }
  const auto bad = train("bad", {"--parallel.mode=zero3"});
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_TRUE(testing::contains(bad.output, "parallel.mode is 'zero3'")) << bad.output;
}

// Two processes: FSDP with activation checkpointing evaluates on every rank (each forward gathers
// from all of them) and trains as DDP does. Per step the losses agree to 1e-5 relative: the same
// fp32 arithmetic except the order of the gradient sums (all-reduce of buckets against
// reduce-scatter of units), a few ulps per step over five steps.
TEST_F(GptExample, FsdpAtTwoRanksTrainsAsDdpDoes) {
  const auto ddp = train_ranks("ddp2", 2, {});
  ASSERT_EQ(ddp.exit_code, 0) << ddp.output;
  const auto fsdp =
      train_ranks("fsdp2", 2, {"--parallel.mode=fsdp", "--train.activation_checkpointing=true"});
  ASSERT_EQ(fsdp.exit_code, 0) << fsdp.output;
  const auto reference = losses("ddp2");
  const auto sharded = losses("fsdp2");
  ASSERT_EQ(reference.size(), 5u);
  ASSERT_EQ(sharded.size(), 5u);
  for (const auto& [step, loss] : reference) {
    EXPECT_NEAR(sharded.at(step), loss, 1e-5 * loss) << "step " << step;
  }
  const json a = result("ddp2")["curve"], b = result("fsdp2")["curve"];
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i]["step"], b[i]["step"]);
    const double loss = a[i]["val_loss"].get<double>();
    EXPECT_NEAR(b[i]["val_loss"].get<double>(), loss, 1e-5 * loss) << "evaluation " << i;
  }
}

// Model parallelism from the command line, as processes under `loom run`: tensor parallelism
// (with sequence parallelism too), a 1F1B pipeline, and pp 2 x dp 2 with FSDP as dp each train as
// DDP at two ranks does (the same global batches: the data is sharded over dp only), and a run
// checkpointed under DDP resumes under pp 2 x tp 2 and continues as the uninterrupted run. Per step
// within 1e-5 relative: the same fp32 arithmetic but for the order of sums (row-parallel partial
// products, the vocabulary-parallel log-sum-exp, micro-batches accumulated, replicas averaged).
TEST_F(GptExample, ModelParallelLayoutsTrainAsDdpDoesAndResumeAcrossThem) {
  const auto ddp = train_ranks("ddp2", 2, {});
  ASSERT_EQ(ddp.exit_code, 0) << ddp.output;
  const auto reference = losses("ddp2");
  ASSERT_EQ(reference.size(), 5u);
  const std::vector<std::pair<std::string, std::vector<std::string>>> layouts = {
      {"tp2", {"--parallel.tp=2"}},
      {"tp2_sp", {"--parallel.tp=2", "--parallel.sequence_parallel=true"}},
      {"pp2", {"--parallel.pp=2", "--parallel.pp_micro_batches=2"}},
      {"pp2_fsdp2", {"--parallel.pp=2", "--parallel.pp_micro_batches=2", "--parallel.mode=fsdp"}},
      {"pp2_tp2_gpipe", {"--parallel.pp=2", "--parallel.tp=2", "--parallel.pp_schedule=gpipe"}}};
  for (const auto& [name, flags] : layouts) {
    const int ranks = name == "tp2" || name == "tp2_sp" || name == "pp2" ? 2 : 4;
    const auto run = train_ranks(name, ranks, flags);
    ASSERT_EQ(run.exit_code, 0) << name << "\n" << run.output;
    const auto got = losses(name);
    ASSERT_EQ(got.size(), reference.size()) << name;
    for (const auto& [step, loss] : reference) {
      EXPECT_NEAR(got.at(step), loss, 1e-5 * loss) << name << ", step " << step;
    }
  }
  // Steps 0..2 under DDP, then 3..4 resumed from its checkpoint under pp 2 x tp 2.
  const auto first = train_ranks("resumed", 2, {"--train.steps=3"});
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const auto second = train_ranks("resumed", 4, {"--parallel.pp=2", "--parallel.tp=2"});
  ASSERT_EQ(second.exit_code, 0) << second.output;
  const auto resumed = losses("resumed");
  ASSERT_EQ(resumed.size(), 5u);
  for (const auto& [step, loss] : reference) {
    EXPECT_NEAR(resumed.at(step), loss, 1e-5 * loss) << "resumed, step " << step;
  }
  // Layouts that do not fit name the numbers.
  const auto bad = train_ranks("bad", 2, {"--parallel.tp=4"});
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_TRUE(testing::contains(bad.output, "which does not divide the world size 2"))
      << bad.output;
  const auto uneven =
      train_ranks("uneven", 4, {"--parallel.pp=2", "--parallel.pp_micro_batches=4"});
  EXPECT_NE(uneven.exit_code, 0);
  EXPECT_TRUE(testing::contains(
      uneven.output,
      "train.batch_size (4) over 2 data-parallel replica(s) is 2 sequences per pipeline step, "
      "which does not split into parallel.pp_micro_batches = 4 micro-batches"))
      << uneven.output;
}

// The pids of the processes whose command line holds every one of `parts`.
std::vector<int> pids_of(const std::vector<std::string>& parts) {
  std::vector<int> out;
  for (const auto& entry : fs::directory_iterator("/proc")) {
    const std::string name = entry.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::string cmdline;
    try {
      cmdline = util::read_file(entry.path() / "cmdline");
    } catch (const Error&) {
      continue;  // exited meanwhile
    }
    bool all = true;
    for (const std::string& part : parts) all = all && testing::contains(cmdline, part);
    if (all) out.push_back(std::stoi(name));
  }
  std::sort(out.begin(), out.end());
  return out;
}

// The job-spec acceptance of issue #22: 2 GPT workers read their batches from a 2-replica data
// service (`loom data service`), beside a job-scoped evaluator. A SIGKILLed data replica
// restarts alone: the workers keep their pids and read through the other replica meanwhile. A
// SIGKILLed worker restarts training (from its checkpoint): the services keep their pids. Every
// step's loss equals, bitwise, the same run reading in process: the service's batches are the
// Reader's, bit for bit, and resume is exact.
TEST_F(GptExample, ADataServiceFeedsTrainingBitForBitThroughReplicaAndWorkerFailures) {
  const std::vector<std::string> flags = {"--train.steps=40", "--train.checkpoint_every=10",
                                          "--train.eval_every=0"};
  const auto local = train_ranks("local", 2, flags);
  ASSERT_EQ(local.exit_code, 0) << local.output;
  const auto reference = losses("local");
  ASSERT_EQ(reference.size(), 40u);

  // Two consecutive free ports: replica r listens on base + r ({port}).
  int base = 0;
  for (int attempt = 0; attempt < 20 && base == 0; ++attempt) {
    const int p = testing::free_port();
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(p + 1));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) base = p;
    ::close(fd);
  }
  ASSERT_NE(base, 0);
  const fs::path run = dir_ / "served";
  const fs::path evaluator = dir_ / "evaluator.py";
  std::ofstream(evaluator) << "import os, sys, time\n"
                              "seen = set()\n"
                              "while True:\n"
                              "    ckpt = os.path.join(os.environ['LOOM_RUN_DIR'], 'ckpt')\n"
                              "    for name in sorted(os.listdir(ckpt)) if os.path.isdir(ckpt) "
                              "else []:\n"
                              "        if name not in seen:\n"
                              "            seen.add(name)\n"
                              "            print('evaluated', name, flush=True)\n"
                              "    time.sleep(0.1)\n";
  std::string train_command;
  for (const std::string& arg : gpt_argv(flags)) train_command += "\"" + arg + "\", ";
  const fs::path job = dir_ / "job.toml";
  std::ofstream(job) << "[group.data]\ncommand = [\"" LOOM_BINARY_DIR
                        "/tools/loom/loom\", \"data\", \"service\", \"--host\", \"127.0.0.1\", "
                        "\"--port\", \"{port}\"]\nplacement = \"spread\"\nreplicas = 2\n"
                        "health = { tcp = "
                     << base
                     << " }\nbackoff_seconds = 3\n"
                        "[group.eval]\ncommand = [\"python3\", \""
                     << evaluator.string()
                     << "\"]\nscope = \"job\"\n"
                        "[group.train]\nkind = \"training\"\ncommand = ["
                     << train_command
                     << "\"--data.service=data\"]\nprocs_per_node = 2\nmax_restarts = 1\n"
                        "after = [\"data\"]\n";
  util::Subprocess launch =
      util::Subprocess::spawn({.argv = {LOOM_BINARY_DIR "/tools/loom/loom", "run", "--run-dir",
                                        run.string(), "--job", job.string()},
                               .output = dir_ / "job.out"});
  const auto job_output = [&] { return util::read_file(dir_ / "job.out"); };
  // Waits until rank 0 has logged step `step`, then stops the workers (SIGSTOP) and returns
  // their pids, so that what follows happens at a known point of training.
  const std::vector<std::string> worker_marks = {kGpt, "--data.service=data"};
  const auto pause_at = [&](int64_t step) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
    while (std::chrono::steady_clock::now() < deadline) {
      try {
        const std::map<int64_t, double> got = losses("served");
        if (!got.empty() && got.rbegin()->first >= step) break;
      } catch (const json::exception&) {  // a line being written
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    std::vector<int> workers = pids_of(worker_marks);
    for (const int pid : workers) ::kill(pid, SIGSTOP);
    return workers;
  };
  const auto services = [&] {
    std::map<std::string, json> out;  // "data/0" -> its entry
    for (const json& e : json::parse(util::read_file(run / "services_node0.json"))) {
      out[e["service"].get<std::string>() + "/" + std::to_string(e["replica"].get<int>())] = e;
    }
    return out;
  };

  // A data replica killed: it restarts alone, after its backoff (3 s); meanwhile the workers
  // read through the other one.
  const std::vector<int> workers = pause_at(5);
  ASSERT_EQ(workers.size(), 2u) << job_output();
  const auto before = services();
  ASSERT_EQ(before.size(), 3u);
  ::kill(before.at("data/0")["pid"].get<int>(), SIGKILL);
  for (const int pid : workers) ::kill(pid, SIGCONT);
  EXPECT_EQ(pause_at(15), workers);  // read through data/1 (the workers' logs say so, below)
  std::map<std::string, json> after;
  for (int i = 0; i < 400; ++i) {
    after = services();
    if (after.at("data/0")["restarts"] == 1 && after.at("data/0")["state"] == "running") break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(after.at("data/0")["restarts"], 1) << after.at("data/0");
  EXPECT_EQ(after.at("data/0")["last_exit"], "killed by signal 9 (Killed)");
  EXPECT_EQ(after.at("data/1")["pid"], before.at("data/1")["pid"]);
  EXPECT_EQ(after.at("eval/0")["pid"], before.at("eval/0")["pid"]);
  for (const int pid : workers) ::kill(pid, SIGCONT);

  // A worker killed: training restarts from its checkpoint (step 20); the services stay.
  const std::vector<int> paused = pause_at(25);
  ASSERT_EQ(paused, workers) << "the data replica's restart restarted a worker";
  ::kill(paused[0], SIGKILL);
  ::kill(paused[1], SIGCONT);
  const util::ExitStatus status = launch.wait();
  ASSERT_TRUE(status.ok()) << status.describe() << "\n" << job_output();
  const auto end = services();  // each stopped at the end, by the job, never restarted again
  for (const char* name : {"data/0", "data/1", "eval/0"}) {
    EXPECT_EQ(end.at(name)["state"], "stopped") << name;
    EXPECT_EQ(end.at(name)["restarts"], std::string(name) == "data/0" ? 1 : 0) << name;
  }
  EXPECT_TRUE(testing::contains(job_output(), "generation 2")) << job_output();
  // The job's status at the coordinator (/api/metrics, `loom top`) holds the same.
  const json job_status = json::parse(util::read_file(run / "job_metrics.json"));
  std::map<std::string, json> reported;
  for (const json& e : job_status.at("services")) {
    reported[e["service"].get<std::string>() + "/" + std::to_string(e["replica"].get<int>())] = e;
  }
  EXPECT_EQ(reported, end);

  // Every step's loss, bitwise; the replica's failure was seen and survived.
  EXPECT_EQ(losses("served"), reference);
  std::string worker_logs;
  for (const auto& entry : fs::directory_iterator(run / "logs")) {
    if (entry.path().filename().string().rfind("worker_", 0) == 0) {
      worker_logs += util::read_file(entry.path());
    }
  }
  EXPECT_TRUE(testing::contains(worker_logs,
                                "data service 'data': 127.0.0.1:" + std::to_string(base) + ": "))
      << worker_logs;
  const std::string evaluated = util::read_file(run / "logs" / "eval_0.out");
  EXPECT_TRUE(testing::contains(evaluated, "evaluated")) << evaluated;
}

TEST_F(GptExample, TheResultIsTheHeldOutLossAfterTheLastStep) {
  const auto run = train("run", {});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const json curve = result("run")["curve"];
  std::vector<int64_t> steps;
  for (const json& point : curve) steps.push_back(point["step"].get<int64_t>());
  EXPECT_EQ(steps, (std::vector<int64_t>{0, 2, 4, 5}));
  EXPECT_NE(curve.back()["val_loss"], curve.front()["val_loss"]);
  EXPECT_TRUE(testing::contains(
      run.output,
      "held-out loss " + fmt_loss(curve.back()["val_loss"].get<double>()) + " after steps 0..5"))
      << run.output;
}

}  // namespace
}  // namespace loom
