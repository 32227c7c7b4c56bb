// The memory a node's `loom run` agent holds for the job's in-memory snapshots: a directory on
// tmpfs (/dev/shm/loom by default) that the workers write their snapshots into
// (LOOM_SNAPSHOT_DIR; train::Trainer) and that outlives them, so that a restarted worker
// resumes from memory instead of disk. It lives as long as the agent: the destructor removes
// it, and an agent that was SIGKILLed leaves a directory that the next agent on the node
// removes (each directory is named after its agent's pid and start time, so a live agent's is
// never taken for a dead one's). docs/checkpoint.md, "In-memory snapshots".
#pragma once

#include <filesystem>
#include <string>

namespace loom::control {

class SnapshotMemory {
 public:
  // Creates `root`/agent-<pid>-<start time>/ after removing the directories under `root` of
  // agents that are no longer running. IoError naming the directory when it cannot be made.
  explicit SnapshotMemory(const std::filesystem::path& root);
  ~SnapshotMemory();  // removes the directory and everything in it
  SnapshotMemory(const SnapshotMemory&) = delete;
  SnapshotMemory& operator=(const SnapshotMemory&) = delete;

  const std::filesystem::path& dir() const { return dir_; }
  // Directories of dead agents removed by the constructor.
  int stale_removed() const { return stale_removed_; }

  // "agent-<pid>-<start time>" of process `pid` now, or "" when it does not exist. The start
  // time (clock ticks since boot, /proc/<pid>/stat) tells a reused pid from the original.
  static std::string owner_name(int pid);

 private:
  std::filesystem::path dir_;  // constant after construction
  int stale_removed_ = 0;
};

}  // namespace loom::control
