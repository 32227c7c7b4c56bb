// Services beside the training workers (services.h).
#include "control/services.h"

#include <algorithm>
#include <csignal>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "control/health.h"
#include "control/service_keys.h"
#include "control/service_registry.h"
#include "loom/error.h"
#include "util/deadline.h"
#include "util/files.h"

namespace loom::control {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

}  // namespace

struct ServiceSupervisor::Process {
  GroupSpec group;
  int replica = 0;
  int port = 0;   // its health check's and endpoint's (GroupSpec::port_of, or the registry's)
  Health health;  // the group's check at `port`
  std::optional<util::Subprocess> process;  // a generation or job service
  std::optional<ServiceRecord> daemon;      // a long-lived service
  bool attached = false;                    // the daemon ran already when the job came
  bool running = false;                     // started and not seen exiting since
  std::string exited;                       // how the last process that exited ended
  bool failed = false;                      // ... and whether that counts as a failure
  int starts = 0;
  int restarts = 0;
  Clock::time_point restart_at{};  // when a pending restart may start
  bool down = false;               // not restarted after a failure: the job fails
  bool done = false;               // exited cleanly and not restarted (restart on-failure/never)
  bool stopped = false;            // stopped by the job (at the end, or for a training restart)
  bool long_lived() const { return group.scope == Scope::kLongLived; }
  std::string name() const { return detail::concat(group.name, "/", replica); }
  std::string log(const std::filesystem::path& run_dir) const {
    return daemon ? daemon->log.string()
                  : (run_dir / "logs" / detail::concat(group.name, "_", replica, ".out")).string();
  }
};

ServiceSupervisor::ServiceSupervisor(const JobSpec& spec, int node, std::filesystem::path run_dir,
                                     std::string host, std::string token,
                                     std::filesystem::path service_dir, Publish publish, Say say)
    : node_(node),
      run_dir_(std::move(run_dir)),
      host_(std::move(host)),
      token_(std::move(token)),
      service_dir_(std::move(service_dir)),
      publish_(std::move(publish)),
      say_(std::move(say)) {
  for (const GroupSpec& g : spec.groups) {
    if (!g.training) replica_counts_[g.name] = g.replica_count(spec.nodes);
  }
  for (const auto& [name, replica] : spec.processes_on(node)) {
    const GroupSpec& group = *spec.find(name);
    if (group.training) continue;
    Process p;
    p.group = group;
    p.replica = replica;
    p.port = group.port_of(replica);
    p.health = group.health;
    p.health.port = p.port;
    processes_.push_back(std::move(p));
  }
  std::filesystem::create_directories(run_dir_ / "logs");
}

ServiceSupervisor::~ServiceSupervisor() = default;  // ~Subprocess kills what still runs

void ServiceSupervisor::launch(Process& p) {
  std::map<std::string, std::string> env = p.group.env_of(p.replica);
  env["LOOM_SERVICE_NAME"] = p.group.name;
  env["LOOM_SERVICE_REPLICA"] = std::to_string(p.replica);
  env["LOOM_RUN_DIR"] = run_dir_.string();
  if (!token_.empty()) env["LOOM_JOB_TOKEN"] = token_;
  ++p.starts;
  p.stopped = false;
  if (p.long_lived()) {
    // Through `loom service`'s registry: attached when it runs already, never stopped here.
    ServiceRegistry registry(service_dir_);
    const ServiceRegistry::Started started = registry.start(
        {.name = p.group.registry_name(p.replica),
         .command = p.group.command_of(p.replica),
         .env = env,
         .health = p.health,
         .ready_timeout = milliseconds(static_cast<int64_t>(p.group.ready_timeout_seconds * 1000))},
        /*attach=*/true);
    p.daemon = started.record;
    p.attached = started.attached;
    if (started.attached && started.record.port > 0 && started.record.port != p.port) {
      say_(detail::concat("service ", p.name(), ": the running ", started.record.name,
                          " listens on port ", started.record.port, ", not ", p.port,
                          " as the job spec says; using its port"));
      p.port = started.record.port;
      p.health.port = p.port;
    }
    p.running = true;
    return;
  }
  const auto log = p.log(run_dir_);
  {
    std::ofstream out(log, std::ios::app);
    out << "---- start " << p.starts << " ----\n";
  }
  p.process = util::Subprocess::spawn(
      {.argv = p.group.command_of(p.replica), .env = env, .output = std::filesystem::path(log)});
  p.running = true;
}

std::optional<std::string> ServiceSupervisor::exited(Process& p) {
  if (!p.running) return std::nullopt;
  if (p.daemon) {
    if (ServiceRegistry::alive(*p.daemon)) return std::nullopt;
    p.running = false;
    p.failed = true;  // its exit status is its parent's (init), not the job's to know
    p.exited = detail::concat("exited (pid ", p.daemon->pid, ", not a child of the job)");
    return p.exited;
  }
  const auto status = p.process->wait_for(milliseconds(0));
  if (!status) return std::nullopt;
  p.running = false;
  p.failed = !status->ok();
  p.exited = status->describe();
  return p.exited;
}

void ServiceSupervisor::wait_ready(Process& p) {
  const auto timeout = milliseconds(static_cast<int64_t>(p.group.ready_timeout_seconds * 1000));
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    if (const auto status = exited(p)) {
      throw Error(detail::concat("service ", p.name(), " (", p.group.command.front(), ") ", *status,
                                 " before it was ready; see ", p.log(run_dir_)));
    }
    if (healthy(p.health)) break;
    LOOM_CHECK(!util::expired(deadline), Timeout, "service ", p.name(), " was not ready within ",
               p.group.ready_timeout_seconds, " s (health: ", describe(p.health),
               "); raise ready_timeout_seconds or see ", p.log(run_dir_));
    std::this_thread::sleep_for(milliseconds(100));
  }
  publish_(service_replica_key(p.group.name, p.replica),
           p.port > 0 ? detail::concat(host_, ":", p.port) : host_);
}

void ServiceSupervisor::start_where(Scope only, bool all) {
  for (Process& p : processes_) {
    if (!all && p.group.scope != only) continue;
    launch(p);
    wait_ready(p);
    const pid_t pid = p.daemon ? p.daemon->pid : p.process->pid();
    if (p.attached) {
      say_(detail::concat("service ", p.name(), " attached: long-lived ",
                          p.group.registry_name(p.replica), " runs already (pid ", pid, ", ",
                          describe(p.health), ")"));
    } else {
      say_(detail::concat("service ", p.name(), " ready (pid ", pid, ", ", describe(p.health),
                          p.long_lived() ? "; long-lived: it outlives the job" : "", ")"));
    }
  }
  write_state();
}

void ServiceSupervisor::start() {
  std::string names;
  for (const auto& [name, count] : replica_counts_) {
    names += (names.empty() ? "" : ",") + name;
    publish_(service_count_key(name), std::to_string(count));
  }
  publish_(kServicesKey, names);
  start_where(Scope::kJob, /*all=*/true);
}

void ServiceSupervisor::start_generation() { start_where(Scope::kGeneration, /*all=*/false); }

std::optional<std::string> ServiceSupervisor::poll() {
  bool changed = false;
  for (Process& p : processes_) {
    if (p.down || p.done || p.stopped) continue;
    if (p.running) {
      const auto status = exited(p);
      if (!status) continue;
      changed = true;
      const bool restart = p.group.restart == RestartPolicy::kAlways ||
                           (p.group.restart == RestartPolicy::kOnFailure && p.failed);
      if (!restart) {
        if (!p.failed) {
          say_(detail::concat("service ", p.name(), " exited with code 0; not restarted (restart ",
                              to_string(p.group.restart), ")"));
          p.done = true;
          continue;
        }
        p.down = true;
        write_state();
        return detail::concat("service ", p.name(), " ", *status, " (restart never)");
      }
      if (p.restarts >= p.group.max_restarts) {
        p.down = true;
        write_state();
        return detail::concat("service ", p.name(), " ", *status, " and has used its ",
                              p.group.max_restarts, " restart(s) (max_restarts)");
      }
      // Exponential backoff from backoff_seconds, doubling with each restart.
      const double backoff =
          p.group.backoff_seconds * static_cast<double>(1 << std::min(p.restarts, 10));
      p.restart_at = Clock::now() + milliseconds(static_cast<int64_t>(backoff * 1000));
      say_(detail::concat("service ", p.name(), " ", *status, "; restarting it in ", backoff,
                          " s (", p.restarts + 1, " of ", p.group.max_restarts, ")"));
    }
    if (!p.running && Clock::now() >= p.restart_at) {
      ++p.restarts;
      try {
        launch(p);
        wait_ready(p);
      } catch (const Error& e) {
        p.down = true;
        write_state();
        return detail::concat("restarting ", e.what());
      }
      say_(detail::concat("service ", p.name(), " restarted and ready (pid ",
                          p.daemon ? p.daemon->pid : p.process->pid(), ")"));
      changed = true;
    }
  }
  if (changed) write_state();
  return std::nullopt;
}

void ServiceSupervisor::stop_where(Scope only, bool all, milliseconds grace) {
  std::vector<Process*> stopping;
  for (auto it = processes_.rbegin(); it != processes_.rend(); ++it) {
    if (!all && it->group.scope != only) continue;
    if (it->long_lived()) {
      if (it->running && !it->stopped) {
        say_(detail::concat("service ", it->name(), " is long-lived: left running (pid ",
                            it->daemon->pid, "; `loom service stop ",
                            it->group.registry_name(it->replica), "` stops it)"));
      }
      it->stopped = true;
      continue;
    }
    it->stopped = true;
    if (it->running) {
      it->process->signal(SIGTERM);
      stopping.push_back(&*it);
    }
  }
  const auto deadline = Clock::now() + grace;
  for (Process* p : stopping) {
    auto status = p->process->wait_for(util::time_left(deadline));
    if (!status) {
      say_(detail::concat("service ", p->name(), " did not stop within ", grace.count(),
                          " ms: SIGKILL"));
      p->process->signal(SIGKILL);
      status = p->process->wait();
    }
    p->running = false;
    p->exited = status->describe();
    if (!all)
      say_(detail::concat("service ", p->name(), " stopped with the workers (scope generation)"));
  }
  write_state();
}

void ServiceSupervisor::stop_generation(milliseconds grace) {
  stop_where(Scope::kGeneration, /*all=*/false, grace);
}

void ServiceSupervisor::stop(milliseconds grace) { stop_where(Scope::kJob, /*all=*/true, grace); }

std::map<std::string, std::string> ServiceSupervisor::env() const {
  std::map<std::string, std::string> out;
  for (const Process& p : processes_) {
    std::string& value = out[service_env_name(p.group.name)];
    value += (value.empty() ? "" : ",") + (p.port > 0 ? detail::concat(host_, ":", p.port) : host_);
  }
  return out;
}

int ServiceSupervisor::restarts() const {
  int n = 0;
  for (const Process& p : processes_) n += p.restarts;
  return n;
}

void ServiceSupervisor::write_state() const {
  nlohmann::json out = nlohmann::json::array();
  for (const Process& p : processes_) {
    const char* state = p.down                        ? "down"
                        : p.stopped && p.long_lived() ? "left-running"
                        : p.stopped                   ? "stopped"
                        : p.done                      ? "exited"
                        : p.running                   ? "running"
                                                      : "restarting";
    nlohmann::json entry = {{"service", p.group.name},
                            {"replica", p.replica},
                            {"node", node_},
                            {"scope", to_string(p.group.scope)},
                            {"pid", p.running ? (p.daemon ? p.daemon->pid : p.process->pid()) : 0},
                            {"state", state},
                            {"starts", p.starts},
                            {"restarts", p.restarts},
                            {"last_exit", p.exited},
                            {"health", describe(p.health)},
                            {"endpoint", p.port > 0 ? detail::concat(host_, ":", p.port) : host_},
                            {"log", p.log(run_dir_)}};
    if (p.long_lived()) {
      entry["registry_name"] = p.group.registry_name(p.replica);
      entry["attached"] = p.attached;
    }
    out.push_back(std::move(entry));
  }
  try {
    util::write_file_atomic(run_dir_ / detail::concat("services_node", node_, ".json"),
                            out.dump(1) + "\n", util::Durability::kAtomicOnly);
    publish_(service_status_key(node_), out.dump());  // for the job's status at the coordinator
  } catch (const Error& e) {
    say_(detail::concat("cannot write the services' state: ", e.what()));
  }
}

}  // namespace loom::control
