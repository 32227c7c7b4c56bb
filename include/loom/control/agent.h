// The launcher's agent: one per node. It rendezvouses with the other agents through the
// coordinator (hosting it on node 0), spawns this node's workers with their environment,
// relays their output with a rank prefix, heartbeats, and restarts the workers whenever the
// coordinator ends their generation. `loom run` is a command line around run_agent(); a
// program may embed the launcher by calling it (as torchrun's elastic agent is a library).
// docs/launcher.md.
#pragma once

#include <chrono>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "loom/control/coordinator.h"
#include "loom/control/job_spec.h"
#include "loom/control/tls.h"
#include "loom/visibility.h"

namespace loom::control {

struct AgentOptions {
  std::vector<std::string> program;  // the worker's argv
  int nproc_per_node = 1;            // workers on this node
  int min_nodes = 1;                 // --nnodes MIN:MAX
  int max_nodes = 1;
  int node_rank = -1;               // orders the nodes; node 0 hosts the coordinator
  std::string coordinator;          // host:port; empty = host one on 127.0.0.1, any port
  bool host_coordinator = false;    // host it at `coordinator` (node 0 does)
  bool coordinator_public = false;  // allow listening beyond loopback (needs the token)
  std::string token;                // the job token; every RPC carries it
  // TLS (`--tls-cert/--tls-key/--tls-ca`): all three or none. The hosted coordinator serves
  // cert/key and requires client certificates signed by ca (mutual TLS); this agent and its
  // workers (LOOM_TLS_*) verify the coordinator against ca and present cert/key.
  TlsFiles tls;
  int max_restarts = 0;         // failures tolerated before the job fails
  std::string run_id = "none";  // TORCHELASTIC_RUN_ID (torchrun's --rdzv-id)
  std::filesystem::path run_dir = "runs/loom-run";
  // In-memory snapshots: the agent holds a directory under this root (tmpfs) for the job and
  // gives it to the workers as LOOM_SNAPSHOT_DIR (control/snapshot_memory.h). Empty: none.
  std::filesystem::path snapshot_root = "/dev/shm/loom";
  std::chrono::milliseconds grace{std::chrono::seconds(10)};  // SIGTERM -> SIGKILL
  std::chrono::milliseconds rendezvous_timeout{std::chrono::seconds(120)};
  std::chrono::milliseconds heartbeat_interval{std::chrono::milliseconds(500)};
  std::chrono::milliseconds node_timeout = kDefaultNodeTimeout;
  std::chrono::milliseconds worker_timeout = kDefaultWorkerTimeout;
  std::chrono::milliseconds last_call = kDefaultLastCall;
  // The hosted coordinator's metrics endpoint, straggler detection and hang watchdog
  // (CoordinatorOptions).
  std::string metrics_address;
  double straggler_threshold = CoordinatorOptions{}.straggler_threshold;
  size_t straggler_window = CoordinatorOptions{}.straggler_window;
  double hang_factor = CoordinatorOptions{}.hang_factor;
  double hang_min_seconds = CoordinatorOptions{}.hang_min_seconds;
  // A job spec's services (`loom run --job`): this node's are started in start order before the
  // first generation's workers, each waited for until healthy, restarted alone under their
  // policies, published in the store as services/<name>/<replica> and to the workers as
  // LOOM_SERVICE_<NAME>, and stopped after the workers at the end of the job. The spec's
  // training group is `program` and nproc_per_node. Unset: no services.
  std::optional<JobSpec> job;
};

// Runs the job on this node until it finishes, fails or is stopped by SIGINT/SIGTERM (which it
// installs handlers for). Returns the exit code: 0, the first failed worker's code, or 128 +
// the signal. Bad options are InvalidArgument.
LOOM_API int run_agent(const AgentOptions& options);

}  // namespace loom::control
