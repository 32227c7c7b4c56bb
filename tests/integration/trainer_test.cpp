// train::Trainer end to end, with real processes under `loom run`: bitwise-reproducible
// losses, a SIGKILLed run resumed from its checkpoint matching the uninterrupted run bit for
// bit (DDP and ZeRO-2 at W = 2), resume at another world size, SIGTERM, non-finite gradients.
// The worker is tests/programs/train_probe.cpp.
#include <gtest/gtest.h>

#include <csignal>
#include <fstream>
#include <map>
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
using testing::TempDir;

const std::string kLoom = LOOM_BINARY_DIR "/tools/loom/loom";
const std::string kProbe = LOOM_BINARY_DIR "/tests/loom_train_probe";

class Trainer : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!LOOM_WITH_GRPC) GTEST_SKIP() << "needs `loom run` (LOOM_WITH_GRPC=ON)";
    data::TokenDatasetWriter writer(dir_ / "data", {.vocab_size = 64});
    std::mt19937 rng(7);
    for (int d = 0; d < 100; ++d) {
      std::vector<uint32_t> doc;
      for (int i = 0; i < 60; ++i)
        doc.push_back(static_cast<uint32_t>((i * 7 + d) % 64 ^ (rng() % 2)));
      writer.add_document(doc);
    }
    writer.finish();
  }

  // Runs the probe under `loom run` with `nproc` workers; returns the exit code and output.
  testing::ProgramResult run(const std::string& name, int nproc, std::vector<std::string> extra) {
    std::vector<std::string> argv = {kLoom,
                                     "run",
                                     "--nproc-per-node",
                                     std::to_string(nproc),
                                     "--max-restarts",
                                     "1",
                                     "--run-dir",
                                     (dir_ / name).string(),
                                     "--",
                                     kProbe,
                                     "--probe.data=" + (dir_ / "data").string(),
                                     "--run.threads=1",
                                     "--train.checkpoint_every=4",
                                     "--train.log_every=100"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return testing::run_program(argv, dir_.path());
  }

  // step -> loss bits (hexfloat) of rank r, the last line for each step (a resumed run redoes
  // the steps after its checkpoint), and how many lines there were.
  std::map<int, std::string> losses(const std::string& name, int rank, int* lines = nullptr) {
    std::ifstream in(dir_ / name / ("losses_rank" + std::to_string(rank) + ".txt"));
    std::map<int, std::string> out;
    int count = 0;
    for (int step; in >> step;) {
      in >> out[step];
      ++count;
    }
    if (lines) *lines = count;
    return out;
  }

  TempDir dir_;
};

TEST_F(Trainer, TwoRunsGiveBitwiseIdenticalLosses) {
  auto a = run("a", 2, {"--train.steps=12"});
  ASSERT_EQ(a.exit_code, 0) << a.output;
  auto b = run("b", 2, {"--train.steps=12"});
  ASSERT_EQ(b.exit_code, 0) << b.output;
  for (int r = 0; r < 2; ++r) {
    const auto la = losses("a", r), lb = losses("b", r);
    ASSERT_EQ(la.size(), 12u);
    EXPECT_EQ(la, lb) << "rank " << r;
  }
  EXPECT_NE(losses("a", 0), losses("a", 1)) << "ranks read different samples";
}

// (mode, snapshots): the probe's DataParallel mode; whether `loom run`'s in-memory snapshots
// are taken every step (train.snapshot_every=1, the default) or not at all.
class TrainerResume : public Trainer,
                      public ::testing::WithParamInterface<std::tuple<std::string, bool>> {};

TEST_P(TrainerResume, SigkilledRunResumesBitwiseLikeTheUninterruptedRun) {
  const auto [mode_name, snapshots] = GetParam();
  const std::string mode = "--probe.mode=" + mode_name;
  const std::string every = snapshots ? "--train.snapshot_every=1" : "--train.snapshot_every=0";
  auto whole = run("whole", 2, {"--train.steps=16", mode, every});
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  // Rank 1 SIGKILLs itself in step 10. The newest committed checkpoint then holds step 8, or
  // step 4 when the asynchronous save of step 8 had not committed yet; the newest snapshot is
  // newer: step 10's (the state after 10 steps), copied and written in the background while
  // step 10 ran, or 9 or 8 when that had not committed yet.
  // Steps of at least 30 ms (a stand-in for a larger model's compute) give a snapshot time to
  // commit within the next step, as it does on a real model.
  auto killed =
      run("killed", 2,
          {"--train.steps=16", mode, every, "--probe.kill_at_step=10", "--probe.step_ms=30"});
  ASSERT_EQ(killed.exit_code, 0) << killed.output;
  EXPECT_NE(killed.output.find("generation 1 ended"), std::string::npos) << killed.output;
  int resumed_at = -1;
  std::string source;
  for (const char* what : {"snapshot", "checkpoint"}) {
    const std::string from = std::string("resumed from ") + what + " step ";
    if (const size_t at = killed.output.find(from); at != std::string::npos) {
      resumed_at = std::stoi(killed.output.substr(at + from.size()));
      source = what;
    }
  }
  ASSERT_GE(resumed_at, 0) << killed.output;
  if (snapshots && source == "snapshot") {
    EXPECT_TRUE(resumed_at >= 8 && resumed_at <= 10) << killed.output;
  } else {
    // Without snapshots; or with them, when this machine was too loaded for snapshot 8 or 9 to
    // commit (then the checkpoint of step 8 is the newest state).
    EXPECT_EQ(source, "checkpoint") << killed.output;
    EXPECT_TRUE(resumed_at == 4 || resumed_at == 8) << killed.output;
    if (snapshots) {
      EXPECT_EQ(resumed_at, 8) << killed.output;
    }
  }
  for (int r = 0; r < 2; ++r) {
    int lines = 0;
    const auto resumed = losses("killed", r, &lines);
    // Rank 0 finished step 9 (its all-reduce waited for rank 1's); rank 1 logged 0..9 too,
    // then the resumed run redid the steps from resumed_at.
    EXPECT_EQ(lines, 16 + (10 - resumed_at)) << "rank " << r;
    EXPECT_EQ(resumed, losses("whole", r)) << "rank " << r;
  }
  std::printf("[ recovery ] %s, snapshots %s: resumed from %s step %d, %d steps recomputed\n",
              mode_name.c_str(), snapshots ? "on" : "off", source.c_str(), resumed_at,
              10 - resumed_at);
}

INSTANTIATE_TEST_SUITE_P(Modes, TrainerResume,
                         ::testing::Combine(::testing::Values("ddp", "zero2"), ::testing::Bool()));

TEST_F(Trainer, ResumesAtAnotherWorldSize) {
  auto two = run("elastic", 2, {"--train.steps=8", "--probe.mode=zero2"});
  ASSERT_EQ(two.exit_code, 0) << two.output;
  auto one = run("elastic", 1, {"--train.steps=12", "--probe.mode=zero2"});
  ASSERT_EQ(one.exit_code, 0) << one.output;
  EXPECT_NE(one.output.find("resumed from checkpoint step 8"), std::string::npos) << one.output;
  EXPECT_NE(one.output.find("world size 1 from a checkpoint saved at 2"), std::string::npos)
      << one.output;
  EXPECT_EQ(losses("elastic", 0).size(), 12u);
}

// The issue-23 model change: the hidden layer lost its bias since the save. Resuming (here at
// another world size, where the per-rank RNG is knowingly left out) names the dropped
// tensors; train.resume_strict=false resumes and warns with the same names.
TEST_F(Trainer, ResumingAChangedModelNamesWhatTheCheckpointHasAndTheModelNot) {
  ASSERT_EQ(run("changed", 2, {"--train.steps=4"}).exit_code, 0);
  auto strict = run("changed", 1, {"--train.steps=6", "--probe.hidden_bias=false"});
  EXPECT_NE(strict.exit_code, 0) << strict.output;
  for (const char* name :
       {"tensor \"model/hidden.bias\" is in the checkpoint but the state does "
        "not have it",
        "tensor \"optim/hidden.bias/exp_avg\"", "tensor \"optim/hidden.bias/exp_avg_sq\""}) {
    EXPECT_NE(strict.output.find(name), std::string::npos) << name << "\n" << strict.output;
  }
  EXPECT_EQ(strict.output.find("resumed from checkpoint"), std::string::npos) << strict.output;
  auto lenient =
      run("changed", 1,
          {"--train.steps=6", "--probe.hidden_bias=false", "--train.resume_strict=false"});
  ASSERT_EQ(lenient.exit_code, 0) << lenient.output;
  EXPECT_NE(lenient.output.find("left out 3 entries the state does not have: tensor "
                                "\"model/hidden.bias\""),
            std::string::npos)
      << lenient.output;
  EXPECT_NE(lenient.output.find("resumed from checkpoint step 4"), std::string::npos)
      << lenient.output;
  // The unchanged model resumes at the same world size without a word about left-out entries.
  ASSERT_EQ(run("same", 2, {"--train.steps=4"}).exit_code, 0);
  auto same = run("same", 2, {"--train.steps=6"});
  ASSERT_EQ(same.exit_code, 0) << same.output;
  EXPECT_EQ(same.output.find("left out"), std::string::npos) << same.output;
}

// A checkpoint whose 'trainer' blob lacks its step, or holds one of the wrong type (a hand
// edit, another program's checkpoint), stops the resume with CorruptData naming the step, its
// directory and what is wrong, not with nlohmann's exception.
TEST_F(Trainer, ACorruptTrainerBlobStopsTheResumeNamingTheStep) {
  ASSERT_EQ(run("blob", 1, {"--train.steps=4"}).exit_code, 0);
  const fs::path step_dir = dir_ / "blob" / "ckpt" / "step_00000004";
  nlohmann::json manifest = nlohmann::json::parse(util::read_file(step_dir / "manifest.json"));
  manifest["blobs"]["trainer"] = {{"step", "four"}};
  util::write_file_atomic(step_dir / "manifest.json", manifest.dump(1));
  const std::string cause = "\"step\" is \"four\", not an integer that fits 64 bits";
  const auto resumed = run("blob", 1, {"--train.steps=6"});
  EXPECT_NE(resumed.exit_code, 0) << resumed.output;
  const std::string expected = "resuming from checkpoint step 4 (" + step_dir.string() +
                               "): its 'trainer' blob is corrupt (" + cause +
                               "): {\"step\":\"four\"}. Remove that step to resume from an "
                               "earlier one.";
  EXPECT_NE(resumed.output.find(expected), std::string::npos) << expected << "\n" << resumed.output;
}

// train.init_from: the weights of a ZeRO-1 run at world size 2, exported to safetensors (the
// flat pieces gathered) and imported back, start a new run whose losses equal, bit for bit,
// those of a run started from the original checkpoint's weights, and differ from a fresh
// start; a model that does not match the weights is named.
TEST_F(Trainer, InitFromImportedWeightsStartsLikeTheOriginalWeights) {
  ASSERT_EQ(run("a", 2, {"--train.steps=4", "--probe.mode=zero1"}).exit_code, 0);
  const std::string exported = (dir_ / "a.safetensors").string();
  auto ex = testing::run_program({kLoom, "ckpt", "export", (dir_ / "a" / "ckpt").string(), "latest",
                                  exported, "--format", "safetensors"},
                                 dir_.path());
  ASSERT_EQ(ex.exit_code, 0) << ex.output;
  auto im = testing::run_program(
      {kLoom, "ckpt", "import", exported, (dir_ / "imported").string(), "--format", "safetensors"},
      dir_.path());
  ASSERT_EQ(im.exit_code, 0) << im.output;
  auto from_original =
      run("b", 2, {"--train.steps=3", "--train.init_from=" + (dir_ / "a" / "ckpt").string()});
  ASSERT_EQ(from_original.exit_code, 0) << from_original.output;
  EXPECT_NE(from_original.output.find("initialised the model's weights from"), std::string::npos)
      << from_original.output;
  auto from_imported =
      run("c", 2, {"--train.steps=3", "--train.init_from=" + (dir_ / "imported").string()});
  ASSERT_EQ(from_imported.exit_code, 0) << from_imported.output;
  ASSERT_EQ(run("fresh", 2, {"--train.steps=3"}).exit_code, 0);
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(losses("c", r).size(), 3u);
    EXPECT_EQ(losses("b", r), losses("c", r)) << "rank " << r;
    EXPECT_NE(losses("b", r).at(0), losses("fresh", r).at(0)) << "rank " << r;
  }
  auto changed = run("d", 1,
                     {"--train.steps=1", "--probe.hidden_bias=false",
                      "--train.init_from=" + (dir_ / "imported").string()});
  EXPECT_NE(changed.exit_code, 0) << changed.output;
  EXPECT_NE(changed.output.find("model/hidden.bias"), std::string::npos) << changed.output;
}

// The learning rate of each step of rank 0's metrics.jsonl.
std::vector<double> logged_lrs(const fs::path& run_dir) {
  std::vector<double> out;
  std::ifstream in(run_dir / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("lr")) out.push_back(j["lr"].get<double>());
  }
  return out;
}

// train.lr unset: the optimizer's own rate. Set and different: the schedule's rate, and a
// warning naming both.
TEST_F(Trainer, TheOptimizersRateIsUsedUnlessTrainLrIsSetAndThenADifferenceIsAWarning) {
  auto own = run("own", 1, {"--train.steps=3", "--probe.optimizer_lr=0.01"});
  ASSERT_EQ(own.exit_code, 0) << own.output;
  EXPECT_EQ(logged_lrs(dir_ / "own"), std::vector<double>(3, 0.01)) << own.output;
  EXPECT_EQ(own.output.find("differs from the optimizer's"), std::string::npos) << own.output;

  auto set = run("set", 1,
                 {
                     "--train.steps=3",
                     "--probe.optimizer_lr=0.01",
                     "--train.lr=0.002",
                 });
  ASSERT_EQ(set.exit_code, 0) << set.output;
  EXPECT_EQ(logged_lrs(dir_ / "set"), std::vector<double>(3, 0.002)) << set.output;
  EXPECT_NE(set.output.find("(train.lr = 0.002) differs from the optimizer's learning rate 0.01"),
            std::string::npos)
      << set.output;
}

TEST_F(Trainer, SigtermFinishesTheStepAndSaves) {
  std::vector<std::string> argv = {kLoom,
                                   "run",
                                   "--nproc-per-node",
                                   "2",
                                   "--run-dir",
                                   (dir_ / "stop").string(),
                                   "--",
                                   kProbe,
                                   "--probe.data=" + (dir_ / "data").string(),
                                   "--run.threads=1",
                                   "--train.steps=100000",
                                   "--train.checkpoint_every=50",
                                   "--train.log_every=100000"};
  auto job = util::Subprocess::spawn({.argv = argv, .output = dir_ / "stop.out"});
  const fs::path losses_file = dir_ / "stop" / "losses_rank0.txt";
  for (int i = 0; i < 600 && (!fs::exists(losses_file) || fs::file_size(losses_file) < 2000); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  job.signal(SIGTERM);
  const auto status = job.wait_for(std::chrono::seconds(60));
  ASSERT_TRUE(status.has_value());
  const std::string output = util::read_file(dir_ / "stop.out");
  EXPECT_EQ(status->code, 128 + SIGTERM) << output;
  EXPECT_NE(output.find("stop requested"), std::string::npos) << output;
  const auto done = losses("stop", 0);
  ASSERT_FALSE(done.empty());
  const int steps_done = done.rbegin()->first + 1;
  char name[32];
  std::snprintf(name, sizeof name, "step_%08d", steps_done);
  EXPECT_TRUE(fs::exists(dir_ / "stop" / "ckpt" / name / "manifest.json"))
      << "no checkpoint of the last step " << name;
}

TEST_F(Trainer, NonFiniteGradientsStopNamingTheParameterOrAreSkipped) {
  auto stop = run("nan", 1, {"--train.steps=6", "--train.lr=1e30", "--train.grad_clip=0"});
  EXPECT_NE(stop.exit_code, 0) << stop.output;
  EXPECT_NE(stop.output.find("first non-finite gradient on rank 0: "), std::string::npos)
      << stop.output;
  auto skip = run(
      "skip", 1,
      {"--train.steps=6", "--train.lr=1e30", "--train.grad_clip=0", "--train.on_non_finite=skip"});
  EXPECT_EQ(skip.exit_code, 0) << skip.output;
  EXPECT_NE(skip.output.find("step skipped"), std::string::npos) << skip.output;
}

// Node loss with in-memory snapshots: two agents of two workers each, no checkpoint on disk
// before the end, and node 1's agent SIGKILLed mid-run. Node 0 alone (the elastic job
// shrinks to world size 2) resumes from the newest snapshot, whole on node 0 because its agent
// copied node 1's files: none of the work before it is redone.
TEST_F(Trainer, ALostNodesSnapshotIsResumedFromTheCopyOnTheOtherNode) {
  const std::string coordinator = "127.0.0.1:" + std::to_string(testing::free_port());
  auto node = [&](int rank) {
    std::vector<std::string> argv = {kLoom,
                                     "run",
                                     "--nnodes",
                                     "1:2",
                                     "--node-rank",
                                     std::to_string(rank),
                                     "--nproc-per-node",
                                     "2",
                                     "--coordinator",
                                     coordinator,
                                     "--node-timeout",
                                     "2",
                                     "--last-call",
                                     "1",
                                     "--grace-period",
                                     "2",
                                     "--max-restarts",
                                     "1",
                                     "--run-dir",
                                     (dir_ / "lost").string(),
                                     "--",
                                     kProbe,
                                     "--probe.data=" + (dir_ / "data").string(),
                                     "--probe.step_ms=100",
                                     "--run.threads=1",
                                     "--train.steps=40",
                                     "--train.checkpoint_every=0",
                                     "--train.snapshot_every=1",
                                     "--train.log_every=100"};
    return util::Subprocess::spawn(
        {.argv = argv, .output = dir_ / ("node" + std::to_string(rank) + ".out")});
  };
  auto node0 = node(0);
  auto node1 = node(1);
  const fs::path progress = dir_ / "lost" / "losses_rank0.txt";
  for (int i = 0; i < 1200 && losses("lost", 0).size() < 10; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_GE(losses("lost", 0).size(), 10u) << util::read_file(dir_ / "node0.out");
  // Node 1 is lost: its agent (with its memory and its server) and its workers die at once.
  for (int pid : util::child_pids(node1.pid())) ::kill(pid, SIGKILL);
  node1.signal(SIGKILL);
  const int steps_before = static_cast<int>(losses("lost", 0).size());
  const auto status = node0.wait_for(std::chrono::seconds(120));
  ASSERT_TRUE(status.has_value());
  const std::string output = util::read_file(dir_ / "node0.out");
  ASSERT_EQ(status->code, 0) << output;
  const std::string said = "resumed from snapshot step ";
  const size_t at = output.find(said);
  ASSERT_NE(at, std::string::npos) << output;
  const int resumed_at = std::stoi(output.substr(at + said.size()));
  EXPECT_NE(output.find("resuming at world size 2 from a checkpoint saved at 4"), std::string::npos)
      << output;
  // Behind the last step node 0 finished by the snapshot's commit and its replication (the
  // agents poll every 100 ms): up to 3 steps of 100 ms here (measured 1 to 3); on a loaded
  // machine a few more.
  EXPECT_GE(resumed_at, std::max(1, steps_before - 6)) << output;
  EXPECT_LE(resumed_at, steps_before + 1) << output;
  int lines = 0;
  const auto done = losses("lost", 0, &lines);
  EXPECT_EQ(done.size(), 40u);
  EXPECT_EQ(done.begin()->first, 0);
  std::printf(
      "[ node loss ] node 1 lost after %d steps; world size 2 resumed from snapshot "
      "step %d; %d steps recomputed\n",
      steps_before, resumed_at, lines - 40);
}

}  // namespace
}  // namespace loom
