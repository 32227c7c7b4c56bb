// Snapshot replication between two agents' memories on loopback: each node ends up with the
// other's files of the newest committed step (and node 1 with node 0's manifest), bit for bit;
// uncommitted steps and copied files are not passed on; requests without the job token are
// refused.
#include "control/snapshot_replication.h"

#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "harness/harness.h"
#include "loom/data/remote.h"
#include "util/files.h"

namespace loom::control {
namespace {

namespace fs = std::filesystem;

// `bytes` random bytes at dir/step/name.
std::string put(const fs::path& dir, const std::string& step, const std::string& name, size_t bytes,
                unsigned seed) {
  std::mt19937 rng(seed);
  std::string data(bytes, '\0');
  for (char& c : data) c = static_cast<char>(rng());
  fs::create_directories(dir / step);
  std::ofstream(dir / step / name, std::ios::binary) << data;
  return data;
}

// Waits (up to 20 s) until `done` holds; false if it never did.
template <typename Fn>
bool eventually(Fn done) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

TEST(SnapshotReplication, TwoNodesEndWithEachOthersFilesOfTheNewestCommittedStep) {
  testing::TempDir a, b;
  // Node 0 (ranks 0, 1) committed step 5 and is writing step 6; node 1 (ranks 2, 3) wrote its
  // files of both. A leftover part file is never served.
  const std::string r0 = put(a.path(), "step_00000005", "rank_00000.data", 3 << 20, 1);
  const std::string r1 = put(a.path(), "step_00000005", "rank_00001.data", 1000, 2);
  const std::string manifest = put(a.path(), "step_00000005", "manifest.json", 700, 3);
  put(a.path(), "step_00000006", "rank_00000.data", 100, 4);
  const std::string r2 = put(b.path(), "step_00000005", "rank_00002.data", 5000, 5);
  const std::string r3 = put(b.path(), "step_00000005", "rank_00003.data", 0, 6);
  put(b.path(), "step_00000005", ".rank_00009.data.part", 10, 7);
  put(b.path(), "step_00000006", "rank_00002.data", 100, 8);

  SnapshotReplication node0(a.path(), "127.0.0.1", "job-token");
  SnapshotReplication node1(b.path(), "127.0.0.1", "job-token");
  node0.follow(node1.url(), "");
  node1.follow(node0.url(), node0.url());
  ASSERT_TRUE(eventually([&] { return node0.stats().steps == 1 && node1.stats().steps == 1; }))
      << node0.stats().last_error << "\n"
      << node1.stats().last_error;

  const auto read = [](const fs::path& p) { return util::read_file(p); };
  EXPECT_EQ(read(a / "step_00000005" / "rank_00002.data"), r2);
  EXPECT_EQ(read(a / "step_00000005" / "rank_00003.data"), r3);
  EXPECT_EQ(read(b / "step_00000005" / "rank_00000.data"), r0);
  EXPECT_EQ(read(b / "step_00000005" / "rank_00001.data"), r1);
  EXPECT_EQ(read(b / "step_00000005" / "manifest.json"), manifest);
  EXPECT_FALSE(fs::exists(a / "step_00000005" / ".rank_00009.data.part"));
  EXPECT_FALSE(fs::exists(a / "step_00000006" / "rank_00002.data")) << "step 6 is not committed";
  EXPECT_FALSE(fs::exists(b / "step_00000006" / "rank_00000.data"));
  const ReplicationStats s0 = node0.stats(), s1 = node1.stats();
  EXPECT_EQ(s0.files, 2);
  EXPECT_EQ(s0.bytes, r2.size() + r3.size());
  EXPECT_EQ(s0.newest_step, 5);
  EXPECT_EQ(s1.files, 2);
  EXPECT_EQ(s1.bytes, r0.size() + r1.size());

  // What a node serves as its own: not the files it copied (no chain copies around a ring).
  data::RemoteClient client({.headers = {"X-Loom-Token: job-token"}});
  const nlohmann::json index = nlohmann::json::parse(client.get(node0.url() + "/index"));
  nlohmann::json step5;
  for (const auto& s : index.at("steps"))
    if (s.at("step") == 5) step5 = s;
  EXPECT_EQ(step5.at("files"),
            nlohmann::json({{"rank_00000.data", r0.size()}, {"rank_00001.data", r1.size()}}));
  EXPECT_EQ(step5.at("manifest"), static_cast<int64_t>(manifest.size()));

  // A request without the job token is refused.
  try {
    data::RemoteClient({.attempts = 1}).get(node0.url() + "/index");
    FAIL() << "no error";
  } catch (const data::RemoteError& e) {
    EXPECT_EQ(e.status(), 403);
  }

  // Step 6 commits on node 0: both copies follow.
  const std::string m6 = put(a.path(), "step_00000006", "manifest.json", 50, 9);
  ASSERT_TRUE(eventually([&] { return node0.stats().steps == 2 && node1.stats().steps == 2; }));
  EXPECT_EQ(read(b / "step_00000006" / "manifest.json"), m6);
  EXPECT_TRUE(fs::exists(a / "step_00000006" / "rank_00002.data"));
}

}  // namespace
}  // namespace loom::control
