// SnapshotMemory: the agent's tmpfs directory for in-memory snapshots, and the removal of
// those that dead agents left behind.
#include "control/snapshot_memory.h"

#include <unistd.h>

#include <cstdio>
#include <sstream>
#include <vector>

#include "loom/error.h"
#include "util/files.h"

namespace loom::control {

namespace fs = std::filesystem;

std::string SnapshotMemory::owner_name(int pid) {
  std::string stat;
  try {
    stat = util::read_file(detail::concat("/proc/", pid, "/stat"));
  } catch (const Error&) {
    return "";  // no such process
  }
  // "pid (comm) state ppid ...": the command may hold spaces and parentheses, so fields are
  // counted after the last ')'. starttime is field 22, the 20th after it.
  const size_t paren = stat.rfind(')');
  if (paren == std::string::npos) return "";
  std::istringstream rest(stat.substr(paren + 1));
  std::string field;
  for (int i = 0; i < 20 && (rest >> field); ++i) {
  }
  if (!rest) return "";
  return detail::concat("agent-", pid, "-", field);
}

SnapshotMemory::SnapshotMemory(const fs::path& root) {
  std::error_code ec;
  fs::create_directories(root, ec);
  LOOM_CHECK(!ec, IoError, "cannot create the snapshot memory ", root.string(), ": ", ec.message(),
             "; pass --snapshot-root on a tmpfs you can write, or --no-snapshots");
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const std::string name = entry.path().filename().string();
    int pid = 0;
    if (std::sscanf(name.c_str(), "agent-%d-", &pid) != 1 || pid <= 0) continue;
    if (owner_name(pid) == name) continue;  // its agent is alive
    fs::remove_all(entry.path(), ec);
    if (!ec) ++stale_removed_;
  }
  dir_ = root / owner_name(static_cast<int>(::getpid()));
  fs::create_directories(dir_, ec);
  LOOM_CHECK(!ec, IoError, "cannot create the snapshot memory ", dir_.string(), ": ", ec.message(),
             "; pass --snapshot-root on a tmpfs you can write, or --no-snapshots");
}

SnapshotMemory::~SnapshotMemory() {
  std::error_code ec;
  fs::remove_all(dir_, ec);
}

}  // namespace loom::control
