// A job spec: the process groups of one job, declared in a TOML file that `loom run --job`
// reads. The training workers are one group; services (a data service, an evaluator, a reward
// model, a per-node cache) are others, each with its placement, restart policy, scope, health
// check, start order and environment. This is the spec and its checks; docs/launcher.md, "Job
// specs", says which parts `loom run` carries out so far.
//
//   [job]
//   nodes = 2
//
//   [group.train]
//   kind = "training"
//   command = ["build/examples/gpt", "--config=examples/gpt/configs/tiny.toml"]
//   procs_per_node = 2
//   after = ["data"]                  # starts once every data replica is ready
//
//   [group.data]
//   command = ["loom", "data", "service", "--port", "{port}"]
//   placement = "spread"              # "every-node", "node:N" or "spread" (with replicas)
//   replicas = 2
//   restart = "on-failure"            # "always", "on-failure" or "never"
//   max_restarts = 5
//   backoff_seconds = 1.0
//   scope = "job"                     # "generation", "job" or "long-lived"
//   health = { tcp = 7000 }           # or { http = "/healthz", port = 8080 }, or { heartbeat =
//   true } ready_timeout_seconds = 60 env = { OMP_NUM_THREADS = "1" } cpus = [0, 1]
//
// Every error names the file, the line and the key (ConfigError).
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "loom/visibility.h"

namespace loom::control {

enum class RestartPolicy { kAlways, kOnFailure, kNever };
// generation: stopped and started with the training workers at every restart; job: survives
// training restarts, stopped at the end of the job; long-lived: outlives the job (managed by
// `loom service`).
enum class Scope { kGeneration, kJob, kLongLived };

struct Placement {
  enum class Kind { kEveryNode, kNode, kSpread } kind = Kind::kEveryNode;
  int node = 0;      // kNode: which node
  int replicas = 1;  // kSpread: how many, spread round-robin over the nodes
};

struct Health {
  enum class Kind { kNone, kTcp, kHttp, kHeartbeat } kind = Kind::kNone;
  int port = 0;      // kTcp, kHttp
  std::string path;  // kHttp: e.g. "/healthz"
};

struct LOOM_API GroupSpec {
  std::string name;
  bool training = false;  // kind = "training": the job's workers (one group per job)
  std::vector<std::string> command;
  int procs_per_node = 1;  // training only
  Placement placement;     // services only
  RestartPolicy restart = RestartPolicy::kOnFailure;
  int max_restarts = 3;
  double backoff_seconds = 1.0;
  Scope scope = Scope::kJob;  // the training group is always kGeneration
  Health health;
  double ready_timeout_seconds = 60;
  std::vector<std::string> after;  // groups that must be ready before this one starts
  std::map<std::string, std::string> env;
  std::vector<int> cpus;  // cores to pin to; empty: no pinning
  int line = 0;           // where the group's table starts in the file

  // Replica r of a service listens on the health check's port + r, so that several replicas
  // on one node do not collide (a group placed on every node: r is the node's index). Its
  // health check, published endpoint and LOOM_SERVICE_<NAME> use that port; 0 when the health
  // check has none.
  int port_of(int replica) const;
  // The command and env of replica r: "{port}" replaced by port_of(r) and "{replica}" by r in
  // every argument and value (other braces are left as they are).
  std::vector<std::string> command_of(int replica) const;
  std::map<std::string, std::string> env_of(int replica) const;
  // How many replicas the service has in a job of `nodes` nodes (JobSpec::nodes).
  int replica_count(int nodes) const;
  // The name a long-lived replica has in `loom service`'s registry: the group's name for
  // replica 0, "<name>@<r>" for replica r > 0.
  std::string registry_name(int replica) const;
};

struct LOOM_API JobSpec {
  std::filesystem::path file;
  int nodes = 1;
  std::vector<GroupSpec> groups;  // in the file's order

  const GroupSpec& training() const;
  const GroupSpec* find(const std::string& name) const;
  // Groups in an order that starts every group after those it waits for (`after`), ties kept
  // in the file's order.
  std::vector<std::string> start_order() const;
  // The processes of node `node`: (group, replica index) pairs, in start order; a training
  // group's replicas are its procs_per_node local ranks.
  std::vector<std::pair<std::string, int>> processes_on(int node) const;
};

// Reads and checks a job spec. ConfigError naming the file, the line and the key for malformed
// TOML, an unknown key or value, a missing command, not exactly one training group, a placement
// the job's nodes cannot meet, an `after` naming an unknown group, or a cycle in start order
// (naming it: "data -> prep -> data").
LOOM_API JobSpec parse_job_spec(const std::filesystem::path& file);
// The plan `loom run --job FILE --check` prints: the groups, their policies and each node's
// processes in start order.
LOOM_API std::string describe_plan(const JobSpec& spec);

LOOM_API const char* to_string(RestartPolicy policy);
LOOM_API const char* to_string(Scope scope);

}  // namespace loom::control
