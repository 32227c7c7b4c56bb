// Chaos under `loom run`: workers SIGKILLed at random moments of a training run, several times;
// the run must end with the failure-free run's final parameters, bit for bit, and the same
// loss at every step. With in-memory snapshots every step, the steps recomputed per failure
// are counted and printed. The worker is tests/programs/train_probe.cpp.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/types.h>

#include <chrono>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <thread>

#include "harness/harness.h"
#include "loom/data/dataset.h"
#include "util/files.h"
#include "util/subprocess.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

const std::string kLoom = LOOM_BINARY_DIR "/tools/loom/loom";
const std::string kProbe = LOOM_BINARY_DIR "/tests/loom_train_probe";

// Lines of a losses file: one per step a rank finished, steps redone after a restart included.
int lines_of(const fs::path& file) {
  std::ifstream in(file);
  int n = 0;
  for (std::string line; std::getline(in, line);) ++n;
  return n;
}

std::map<int, std::string> losses(const fs::path& file) {
  std::ifstream in(file);
  std::map<int, std::string> out;
  for (int step; in >> step;) in >> out[step];
  return out;
}

class Chaos : public ::testing::Test {
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

  std::vector<std::string> argv(const std::string& name) const {
    return {kLoom,
            "run",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "20",
            "--grace-period",
            "2",
            "--run-dir",
            (dir_ / name).string(),
            "--",
            kProbe,
            "--probe.data=" + (dir_ / "data").string(),
            "--probe.mode=zero2",
            "--probe.step_ms=40",
            "--run.threads=1",
            "--train.steps=40",
            "--train.checkpoint_every=10",
            "--train.snapshot_every=1",
            "--train.log_every=1000"};
  }

  TempDir dir_;
};

TEST_F(Chaos, RandomWorkerKillsLeaveTheFinalParametersBitwiseTheFailureFreeRuns) {
  const auto clean = testing::run_program(argv("clean"), dir_.path());
  ASSERT_EQ(clean.exit_code, 0) << clean.output;

  auto job = util::Subprocess::spawn({.argv = argv("chaos"), .output = dir_ / "chaos.out"});
  const fs::path progress = dir_ / "chaos" / "losses_rank0.txt";
  std::mt19937 rng(std::random_device{}());
  constexpr int kKills = 4;
  int kills = 0, lines_at_kill = 0;
  std::optional<util::ExitStatus> status;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(240);
  while (!(status = job.wait_for(std::chrono::milliseconds(20)))) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << util::read_file(dir_ / "chaos.out");
    // Each kill lands while the workers train: two more steps finished since the last one,
    // then a random moment within the next steps (inside a step, a save, a commit...).
    if (kills == kKills || lines_of(progress) < lines_at_kill + 2) continue;
    std::this_thread::sleep_for(std::chrono::milliseconds(rng() % 120));
    const std::vector<pid_t> workers = util::child_pids(job.pid());
    if (workers.size() != 2) continue;  // between generations
    const pid_t victim = workers[rng() % workers.size()];
    if (::kill(victim, SIGKILL) == 0) {
      ++kills;
      lines_at_kill = lines_of(progress);
    }
  }
  const std::string output = util::read_file(dir_ / "chaos.out");
  ASSERT_EQ(status->code, 0) << output;
  ASSERT_EQ(kills, kKills) << "the run ended before every kill landed\n" << output;

  for (int r = 0; r < 2; ++r) {
    const std::string name = "params_rank" + std::to_string(r) + ".bin";
    const std::string want = util::read_file(dir_ / "clean" / name);
    ASSERT_FALSE(want.empty());
    EXPECT_TRUE(util::read_file(dir_ / "chaos" / name) == want)
        << "rank " << r << ": the final parameters differ from the failure-free run's";
    const std::string file = "losses_rank" + std::to_string(r) + ".txt";
    EXPECT_EQ(losses(dir_ / "chaos" / file), losses(dir_ / "clean" / file)) << "rank " << r;
  }
  // Steps run more than once: those a failure lost (the work since the resumed state) plus
  // the step each kill interrupted, which was never logged.
  const int recomputed = lines_of(progress) - 40;
  int from_snapshot = 0;
  std::istringstream lines(output);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("[rank 0]", 0) == 0 &&
        line.find("resumed from snapshot step") != std::string::npos)
      ++from_snapshot;
  }
  std::printf(
      "[ chaos ] %d kills, %d resumed from a snapshot, %d steps recomputed (%.2f per "
      "failure)\n",
      kills, from_snapshot, recomputed, static_cast<double>(recomputed) / kills);
}

}  // namespace
}  // namespace loom
