// The services of a job spec that run on one node, beside its training workers: started in
// start order, each waited for until its health check passes, restarted alone under its policy
// (with backoff and a budget), published for discovery, and stopped after the workers. By
// scope: `generation` services are stopped and started again with the workers at every training
// restart; `job` ones live as long as the job; `long-lived` ones are attached to when the
// registry of `loom service` (service_registry.h) has them running, started through it
// otherwise, and never stopped. The `loom run` agent drives it from its one thread. Private to
// Loom.
#pragma once

#include <chrono>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "loom/control/job_spec.h"
#include "util/subprocess.h"

namespace loom::control {

class ServiceSupervisor {
 public:
  // Publishes an endpoint: key "services/<name>/<replica>", value "host:port" (or "host" for a
  // service without a port); called again after a restart.
  using Publish = std::function<void(const std::string& key, const std::string& value)>;
  // Writes one line of the agent's own output ("[loom run] ..."): starts, restarts, stops.
  using Say = std::function<void(const std::string& line)>;

  // The services of `spec` (not its training group) that node `node` runs
  // (JobSpec::processes_on). Logs go to <run_dir>/logs/<name>_<replica>.out (a long-lived
  // service's to the registry's <name>.log), the state of every process to
  // <run_dir>/services_node<node>.json. `service_dir`: the registry of long-lived services.
  // `token`: the job token, given to each service as LOOM_JOB_TOKEN (the workers have it too, so
  // a service can require it of them, as `loom data service` does).
  ServiceSupervisor(const JobSpec& spec, int node, std::filesystem::path run_dir, std::string host,
                    std::string token, std::filesystem::path service_dir, Publish publish, Say say);
  ~ServiceSupervisor();
  ServiceSupervisor(const ServiceSupervisor&) = delete;
  ServiceSupervisor& operator=(const ServiceSupervisor&) = delete;

  // Publishes the job's list of services and each one's replica count (service_keys.h), then
  // starts every process of this node in start order (a long-lived one: attached when running),
  // each waited for until healthy (tcp: the port accepts a connection; http: the path answers
  // 2xx; otherwise: started) before the next. Error naming the service, replica, check and
  // timeout when one is not ready in time, or exits while being waited for.
  void start();
  // A training restart: stop_generation() once the old workers stopped, start_generation()
  // before the new ones start. Only the generation-scoped processes; errors as start()'s.
  void stop_generation(std::chrono::milliseconds grace);
  void start_generation();
  // Restarts the processes that exited, each under its policy and backoff. Returns the reason
  // the job must fail when a process is down for good (restart "never" after a failure, or its
  // max_restarts used up); nullopt otherwise. Never blocks on a process.
  std::optional<std::string> poll();
  // The end of the job: SIGTERM to every process in reverse start order, SIGKILL after `grace`;
  // long-lived ones are left running.
  void stop(std::chrono::milliseconds grace);

  // LOOM_SERVICE_<NAME> ("host:port,host:port" of the replicas on this node) for the workers.
  std::map<std::string, std::string> env() const;
  // Restarts so far, for the log and tests.
  int restarts() const;

 private:
  struct Process;
  void launch(Process& p);
  void wait_ready(Process& p);
  // The status of a process that exited since the last look; nullopt while it runs.
  std::optional<std::string> exited(Process& p);
  void start_where(Scope only, bool all);
  void stop_where(Scope only, bool all, std::chrono::milliseconds grace);
  void write_state() const;

  std::vector<Process> processes_;             // in start order
  std::map<std::string, int> replica_counts_;  // every service of the job: its replicas
  int node_ = 0;
  std::filesystem::path run_dir_;
  std::string host_;
  std::string token_;
  std::filesystem::path service_dir_;
  Publish publish_;
  Say say_;
};

}  // namespace loom::control
