// Crash consistency with real processes: two writer processes (tests/programs/ckpt_writer.cpp)
// save checkpoints back to back over a FileStore and are SIGKILLed together at random moments,
// again and again, until at least 24 kills landed inside a save (a save() begun whose wait()
// had not returned, as the writers' logs tell). After every kill the newest committed step must
// load (resharded to one rank) and verify, hold exactly that step's data, be at least the step
// a writer last reported committed, and no directory without a manifest may ever be taken as
// the newest.
#include <gtest/gtest.h>
#include <signal.h>
#include <torch/torch.h>

#include <algorithm>
#include <random>
#include <sstream>
#include <thread>

#include "ckpt/manifest.h"
#include "harness/harness.h"
#include "loom/ckpt/checkpointer.h"
#include "loom/comm/store.h"
#include "util/files.h"
#include "util/subprocess.h"

namespace loom {
namespace {

constexpr int64_t kRows = 64;
constexpr int64_t kCols = 16 * 1024;

std::vector<util::Subprocess> start_writers(const std::filesystem::path& ckpt_dir,
                                            const std::filesystem::path& store_dir, int saves,
                                            const std::filesystem::path& log_dir) {
  std::vector<util::Subprocess> writers;
  for (int rank = 0; rank < 2; ++rank) {
    util::SubprocessOptions options;
    options.argv = {LOOM_BINARY_DIR "/tests/loom_ckpt_writer",
                    ckpt_dir.string(),
                    store_dir.string(),
                    std::to_string(rank),
                    "2",
                    std::to_string(saves)};
    options.output = log_dir / ("writer_" + std::to_string(rank) + ".log");
    std::filesystem::remove(*options.output);  // output is appended: start each run afresh
    writers.push_back(util::Subprocess::spawn(options));
  }
  return writers;
}

// What a writer's log says when it was killed: the step it last reported committed, and whether
// it was inside a save (its last line is "saving <step>").
struct WriterLog {
  int64_t committed = 0;
  bool inside_save = false;
};

WriterLog read_log(const std::filesystem::path& path) {
  WriterLog log;
  std::istringstream lines(util::read_file(path));
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("saving ", 0) == 0) log.inside_save = true;
    if (line.rfind("committed ", 0) == 0) log = {std::stoll(line.substr(10)), false};
  }
  return log;
}

// Loads the newest committed step on one rank (saved by two), checks its bytes and that the
// data is exactly that step's. Returns the step, or 0 when nothing is committed yet.
int64_t check_newest(const std::filesystem::path& ckpt_dir) {
  comm::InMemoryStore store;
  ckpt::Checkpointer reader(store, {.dir = ckpt_dir});
  auto latest = reader.latest();
  if (!latest) return 0;
  EXPECT_TRUE(std::filesystem::exists(ckpt_dir / ckpt::step_dir_name(*latest) / "manifest.json"));
  reader.verify(*latest);
  ckpt::State state;
  state.add("rows", torch::zeros({kRows, kCols}), ckpt::Sharding::rows({kRows, kCols}, 0, kRows));
  state.add("scalar", torch::zeros({1}, torch::kInt64));
  state.blobs["trainer"] = "";
  EXPECT_EQ(reader.load(state), *latest);
  EXPECT_EQ(state.tensors[1].tensor.item<int64_t>(), *latest);
  torch::Tensor expected =
      torch::arange(kRows * kCols, torch::kFloat32).reshape({kRows, kCols}).add_(*latest);
  EXPECT_TRUE(torch::equal(state.tensors[0].tensor, expected)) << "step " << *latest;
  EXPECT_EQ(state.blobs["trainer"], "{\"step\":" + std::to_string(*latest) + "}");
  // Every older committed step (retention keeps a few) verifies too.
  for (const auto& info : reader.list()) reader.verify(info.step);
  return *latest;
}

TEST(CkptCrash, SigkillAtRandomPointsNeverLeavesABadLatest) {
  testing::TempDir dir("loom-ckpt-crash");
  const auto ckpt_dir = dir / "ckpt";
  std::mt19937 random(20261202);
  // Kills land after the first commit of each run (start-up, loading libtorch, takes ~0.5 s
  // and more on a busy machine), 0-400 ms into the stream of saves (~0.1 s each): in the
  // copy, the writes, the fsyncs, the manifest, the retention.
  std::uniform_int_distribution<int> delay_ms(0, 400);
  constexpr int kInsideSavesWanted = 24, kInsideSavesRequired = 20;
  int64_t newest = 0, reported = 0;
  int kills = 0, inside_saves = 0, advanced = 0, partial = 0;
  const auto start = std::chrono::steady_clock::now();
  while (std::chrono::steady_clock::now() - start < std::chrono::seconds(150) &&
         inside_saves < kInsideSavesWanted && kills < 60) {
    // A fresh store per restart generation, as a launcher provides.
    auto writers =
        start_writers(ckpt_dir, dir / ("store_" + std::to_string(kills)), 1000, dir.path());
    const auto log = dir / "writer_0.log";
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (std::chrono::steady_clock::now() < deadline &&
           util::read_file(log).find("committed " + std::to_string(newest + 1)) ==
               std::string::npos) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms(random)));  // the kill moment
    for (auto& w : writers) w.signal(SIGKILL);
    for (auto& w : writers) w.wait();
    ++kills;
    const WriterLog logs[] = {read_log(dir / "writer_0.log"), read_log(dir / "writer_1.log")};
    if (logs[0].inside_save || logs[1].inside_save) ++inside_saves;
    reported = std::max({reported, logs[0].committed, logs[1].committed});
    if (!ckpt::uncommitted_dirs(ckpt_dir).empty()) ++partial;  // killed while writing a step
    const int64_t latest = check_newest(ckpt_dir);
    ASSERT_FALSE(::testing::Test::HasFailure()) << "after kill " << kills;
    ASSERT_GE(latest, reported) << "after kill " << kills
                                << ": a step reported committed is not among the committed";
    ASSERT_GE(latest, newest) << "after kill " << kills << ": the newest step went backwards";
    if (latest > newest) ++advanced;
    newest = latest;
  }
  std::printf(
      "%d kills, %d inside a save (%d left a partial step directory), the newest step advanced "
      "after %d of them, reached step %lld (last reported committed: %lld)\n",
      kills, inside_saves, partial, advanced, static_cast<long long>(newest),
      static_cast<long long>(reported));
  ASSERT_GE(inside_saves, kInsideSavesRequired) << "too few kills landed inside a save";
  EXPECT_GE(advanced, kills / 2) << "too few saves completed between kills to test much";
  // A clean run after all the crashes commits and cleans up every partial directory.
  auto writers = start_writers(ckpt_dir, dir / "store_final", 2, dir.path());
  for (auto& w : writers) EXPECT_TRUE(w.wait().ok());
  EXPECT_EQ(check_newest(ckpt_dir), newest + 2);
  EXPECT_TRUE(ckpt::uncommitted_dirs(ckpt_dir).empty());
}

}  // namespace
}  // namespace loom
