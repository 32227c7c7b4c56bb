// The registry of long-lived services: processes that outlive the job (or the command) that
// started them, which later jobs attach to by name. `loom service start|ls|logs|stop` manages
// them, and a job spec's `scope = "long-lived"` groups go through the same code. One record
// per service, <dir>/<name>.json; its output goes to <dir>/<name>.log.
//
// A service runs daemonized: in a session of its own, its own process group, stdin from
// /dev/null, never a child of the process that started it (so that neither a job's agent nor
// the `loom` command has to reap it). Whether it is alive is read from /proc: its pid runs, is
// not a zombie, and started when the record says (a later process with a reused pid is not it).
//
// Thread safety: none needed; processes that share a directory are serialized per name by a
// lock file (<dir>/<name>.lock) while they start or stop that service.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "loom/control/job_spec.h"

namespace loom::control {

struct ServiceRecord {
  std::string name;
  std::vector<std::string> command;
  pid_t pid = 0;
  uint64_t proc_start = 0;      // /proc/<pid>/stat's starttime: tells a reused pid apart
  int64_t started_unix_ms = 0;  // wall clock, for the uptime
  int port = 0;                 // 0: none
  std::string health;           // the readiness check, described ("tcp port 7000")
  std::filesystem::path log;    // stdout and stderr, appended
  std::filesystem::path cwd;    // where it runs
  // "127.0.0.1:7000", or "" without a port.
  std::string endpoint() const;
};

struct ServiceStartOptions {
  std::string name;                        // [A-Za-z0-9._@-], not starting with '.'
  std::vector<std::string> command;        // argv; PATH is searched for argv[0]
  std::map<std::string, std::string> env;  // added to (or replacing in) this process's env
  Health health;                           // readiness; its port is the endpoint's
  std::chrono::milliseconds ready_timeout{60000};
};

class ServiceRegistry {
 public:
  // $LOOM_SERVICES_DIR, else ~/.loom/services ($HOME), else /tmp/loom-services-<uid>.
  static std::filesystem::path default_dir();

  // Creates `dir` when missing (IoError naming it when it cannot).
  explicit ServiceRegistry(std::filesystem::path dir);

  const std::filesystem::path& dir() const { return dir_; }
  // Every record, by name, alive or dead. A record that cannot be read is CorruptData naming it.
  std::vector<ServiceRecord> list() const;
  std::optional<ServiceRecord> find(const std::string& name) const;
  // Whether the record's process runs now (not a zombie, not a later process with its pid).
  static bool alive(const ServiceRecord& record);

  struct Started {
    ServiceRecord record;
    bool attached = false;  // it was running already (attach = true)
  };
  // Starts the service daemonized, its output appended to <dir>/<name>.log after a
  // "---- start <time> ----" line, and waits until its health check passes. When a service of
  // that name runs already: with `attach`, returns it (attached); otherwise Error naming its
  // pid and how to stop it. A dead record of that name is replaced. Error naming the log (and
  // quoting its end) when the process exits before it is ready; Timeout naming the check when
  // it is not ready in time (the process is then killed and its record removed).
  Started start(const ServiceStartOptions& options, bool attach = false);
  // SIGTERM to the service's process group, SIGKILL after `grace`; removes the record. Returns
  // false when it was dead already (its record is removed all the same). InvalidArgument
  // naming the services there are when there is no record of `name`.
  bool stop(const std::string& name, std::chrono::milliseconds grace);
  // InvalidArgument for a name that is not [A-Za-z0-9._@-]+ or starts with '.'.
  static void check_name(const std::string& name);
  std::filesystem::path log_path(const std::string& name) const { return dir_ / (name + ".log"); }
  // "no service named 'x' in DIR (services there: a, b)", for the errors of the commands.
  std::string unknown(const std::string& name) const;

 private:
  std::filesystem::path record_path(const std::string& name) const {
    return dir_ / (name + ".json");
  }
  void write(const ServiceRecord& record) const;

  std::filesystem::path dir_;  // constant after construction
};

}  // namespace loom::control
