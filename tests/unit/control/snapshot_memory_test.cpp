// The agent's snapshot memory: its directory, named after the agent, removed with it; the
// directories of dead agents removed by the next one; a live agent's left alone.
#include "control/snapshot_memory.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>

#include "harness/harness.h"
#include "loom/error.h"

namespace loom::control {
namespace {

namespace fs = std::filesystem;

TEST(SnapshotMemory, OwnsADirectoryNamedAfterItsAgentAndRemovesTheDeadOnes) {
  testing::TempDir root;
  const std::string mine = SnapshotMemory::owner_name(static_cast<int>(::getpid()));
  const std::string parent = SnapshotMemory::owner_name(static_cast<int>(::getppid()));
  ASSERT_EQ(mine.rfind("agent-" + std::to_string(::getpid()) + "-", 0), 0u) << mine;
  ASSERT_FALSE(parent.empty());
  EXPECT_EQ(SnapshotMemory::owner_name(0), "");
  // A dead agent's (no such pid), a reused pid's (this process, another start time), a live
  // agent's (the parent, its real name), and something that is no agent's.
  for (const std::string& name :
       {std::string("agent-2147483600-5"), "agent-" + std::to_string(::getpid()) + "-1", parent,
        std::string("not-an-agent")}) {
    fs::create_directories(root / name / "step_00000001");
    std::ofstream(root / name / "step_00000001" / "rank_00000.data") << "bytes";
  }
  {
    SnapshotMemory memory(root.path());
    EXPECT_EQ(memory.dir(), root / mine);
    EXPECT_TRUE(fs::is_directory(memory.dir()));
    EXPECT_EQ(memory.stale_removed(), 2);
    EXPECT_FALSE(fs::exists(root / "agent-2147483600-5"));
    EXPECT_FALSE(fs::exists(root / ("agent-" + std::to_string(::getpid()) + "-1")));
    EXPECT_TRUE(fs::exists(root / parent / "step_00000001" / "rank_00000.data"));
    EXPECT_TRUE(fs::exists(root / "not-an-agent"));
    std::ofstream(memory.dir() / "file") << "snapshot";
  }
  EXPECT_FALSE(fs::exists(root / mine));
}

TEST(SnapshotMemory, AnUnwritableRootIsAnIoErrorSayingWhatToDo) {
  testing::TempDir dir;
  std::ofstream(dir / "file") << "x";
  const std::string error =
      testing::error_of<IoError>([&] { SnapshotMemory memory(dir / "file" / "root"); });
  EXPECT_EQ(error, "cannot create the snapshot memory " + (dir / "file" / "root").string() +
                       ": Not a directory; pass --snapshot-root on a tmpfs you can write, or "
                       "--no-snapshots");
}

}  // namespace
}  // namespace loom::control
