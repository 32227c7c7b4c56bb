// Replication of in-memory snapshots between the agents of a job, so that losing a node loses
// no snapshot. Each agent serves its snapshot memory read-only over HTTP (the job token in
// X-Loom-Token when the job has one) and, in a job of N > 1 nodes, node n copies the committed
// snapshot files of node (n - 1) mod N into its own memory, beside its own ranks' files of the
// same step, plus the step's manifest.json from node 0 (whose rank 0 commits). A node then
// holds every file of a step that it and its predecessor's ranks wrote; in a two-node job,
// every file. After node n - 1 is lost, node n resumes (elastic shrink) from a whole step.
//
// The pull runs on a thread of its own every `interval`: it takes the newest step that node 0
// has committed and downloads what it lacks, one file at a time, through data::RemoteClient
// (retries, resumed range downloads) into a .part file renamed into place when complete; the
// Checkpointer's load verifies every chunk's hash. Replication lags a commit by up to one
// interval plus the transfer: a node lost inside that window leaves the previous step, which
// the snapshots' retention keeps for that reason (train::Trainer keeps two committed snapshots
// in jobs of several nodes). docs/checkpoint.md, "In-memory snapshots".
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>

namespace loom::control {

struct ReplicationStats {
  int64_t steps = 0;         // steps of which this node completed its copy
  int64_t files = 0;         // files downloaded
  uint64_t bytes = 0;        // bytes downloaded
  int64_t newest_step = -1;  // the newest step copied
  std::string last_error;    // why the last round failed ("" after a round that did not)
};

// Thread-safe. The destructor stops the server and the pull.
class SnapshotReplication {
 public:
  // Serves `dir` on `address` (an IP of this host), any port. `token`: required of every
  // request when not empty.
  SnapshotReplication(std::filesystem::path dir, const std::string& address, std::string token,
                      std::chrono::milliseconds interval = std::chrono::milliseconds(100));
  ~SnapshotReplication();
  SnapshotReplication(const SnapshotReplication&) = delete;
  SnapshotReplication& operator=(const SnapshotReplication&) = delete;

  // "http://address:port" of this node's server.
  std::string url() const;
  // Copies from now on the files of `predecessor` (a url() of another agent) and the
  // manifests of `committer` (node 0's; this node's own when empty); replaces what it followed
  // before. follow("", "") stops pulling.
  void follow(const std::string& predecessor, const std::string& committer);
  ReplicationStats stats() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace loom::control
