// `loom service start|ls|logs|stop`: long-lived processes that outlive the command (or job) that
// started them, which later jobs attach to by name (a job spec's scope = "long-lived").
// The registry is src/control/service_registry.h; docs/launcher.md, "Long-lived services".
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include "commands.h"
#include "control/service_registry.h"
#include "loom/error.h"
#include "util/files.h"

namespace loom::cli {
namespace {

using control::ServiceRecord;
using control::ServiceRegistry;
namespace fs = std::filesystem;

struct ServiceArgs {
  std::string dir;  // empty: ServiceRegistry::default_dir()
  std::string name;
  std::vector<std::string> command;
  int port = 0;
  std::string health;  // tcp, http:/path, none; empty: tcp with --port, else none
  double ready_timeout_s = 60;
  std::vector<std::string> env;  // KEY=VALUE
  bool json = false;
  bool follow = false;
  int tail = -1;  // -1: the whole log
  double grace_s = 10;
};

ServiceRegistry registry(const ServiceArgs& args) {
  return ServiceRegistry(args.dir.empty() ? ServiceRegistry::default_dir() : fs::path(args.dir));
}

int64_t now_unix_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// "42s", "3m07s", "2h05m", "3d04h".
std::string duration(int64_t seconds) {
  char text[32];
  if (seconds < 60) {
    std::snprintf(text, sizeof text, "%llds", static_cast<long long>(seconds));
  } else if (seconds < 3600) {
    std::snprintf(text, sizeof text, "%lldm%02llds", static_cast<long long>(seconds / 60),
                  static_cast<long long>(seconds % 60));
  } else if (seconds < 86400) {
    std::snprintf(text, sizeof text, "%lldh%02lldm", static_cast<long long>(seconds / 3600),
                  static_cast<long long>(seconds % 3600 / 60));
  } else {
    std::snprintf(text, sizeof text, "%lldd%02lldh", static_cast<long long>(seconds / 86400),
                  static_cast<long long>(seconds % 86400 / 3600));
  }
  return text;
}

std::string join(const std::vector<std::string>& words) {
  std::string out;
  for (const std::string& w : words) out += (out.empty() ? "" : " ") + w;
  return out;
}

control::Health parse_health(const ServiceArgs& args) {
  control::Health h;
  const std::string kind = args.health.empty() ? (args.port > 0 ? "tcp" : "none") : args.health;
  if (kind == "none") return h;
  LOOM_CHECK(args.port > 0, InvalidArgument, "--health ", kind,
             " needs --port: the port the service listens on");
  h.port = args.port;
  if (kind == "tcp") {
    h.kind = control::Health::Kind::kTcp;
  } else if (kind.rfind("http:/", 0) == 0) {
    h.kind = control::Health::Kind::kHttp;
    h.path = kind.substr(5);
  } else {
    throw InvalidArgument("--health is '" + kind + "'; use tcp, http:/PATH or none");
  }
  return h;
}

int start(const ServiceArgs& args) {
  LOOM_CHECK(!args.command.empty(), InvalidArgument,
             "give the service's command after --: loom service start ", args.name,
             " [--port P] -- program args...");
  control::ServiceStartOptions o;
  o.name = args.name;
  for (const std::string& arg : args.command) {
    std::string a = arg;
    LOOM_CHECK(args.port > 0 || a.find("{port}") == std::string::npos, InvalidArgument,
               "{port} in the command needs --port");
    for (size_t at = a.find("{port}"); at != std::string::npos; at = a.find("{port}", at))
      a.replace(at, 6, std::to_string(args.port));
    o.command.push_back(a);
  }
  for (const std::string& kv : args.env) {
    const auto eq = kv.find('=');
    LOOM_CHECK(eq != std::string::npos && eq > 0, InvalidArgument, "--env '", kv,
               "' is not KEY=VALUE");
    o.env[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  o.env["LOOM_SERVICE_NAME"] = args.name;
  o.health = parse_health(args);
  o.ready_timeout = std::chrono::milliseconds(static_cast<int64_t>(args.ready_timeout_s * 1000));
  const ServiceRecord r = registry(args).start(o).record;
  std::cout << "started " << r.name << ": pid " << r.pid
            << (r.port > 0 ? ", " + r.endpoint() : std::string()) << ", ready (" << r.health
            << "); log " << r.log.string() << "\n";
  return kExitOk;
}

int ls(const ServiceArgs& args) {
  const ServiceRegistry reg = registry(args);
  const std::vector<ServiceRecord> records = reg.list();
  const int64_t now = now_unix_ms();
  if (args.json) {
    nlohmann::json out = nlohmann::json::array();
    for (const ServiceRecord& r : records) {
      const bool alive = ServiceRegistry::alive(r);
      out.push_back({{"name", r.name},
                     {"pid", r.pid},
                     {"state", alive ? "alive" : "dead"},
                     {"endpoint", r.endpoint()},
                     {"port", r.port},
                     {"health", r.health},
                     {"started_unix_ms", r.started_unix_ms},
                     {"uptime_seconds", alive ? (now - r.started_unix_ms) / 1000 : 0},
                     {"command", r.command},
                     {"log", r.log.string()}});
    }
    std::cout << out.dump(1) << "\n";
    return kExitOk;
  }
  if (records.empty()) {
    std::cout << "no services in " << reg.dir().string() << "\n";
    return kExitOk;
  }
  std::vector<std::vector<std::string>> rows = {
      {"NAME", "PID", "STATE", "ENDPOINT", "UPTIME", "COMMAND"}};
  for (const ServiceRecord& r : records) {
    const bool alive = ServiceRegistry::alive(r);
    rows.push_back({r.name, std::to_string(r.pid), alive ? "alive" : "dead",
                    r.port > 0 ? r.endpoint() : "-",
                    alive ? duration((now - r.started_unix_ms) / 1000) : "-", join(r.command)});
  }
  std::vector<size_t> width(rows[0].size(), 0);
  for (const auto& row : rows) {
    for (size_t c = 0; c < row.size(); ++c) width[c] = std::max(width[c], row[c].size());
  }
  for (const auto& row : rows) {
    std::string line;
    for (size_t c = 0; c < row.size(); ++c) {
      line += row[c];
      if (c + 1 < row.size()) line += std::string(width[c] - row[c].size() + 2, ' ');
    }
    std::cout << line << "\n";
  }
  return kExitOk;
}

int logs(const ServiceArgs& args) {
  const ServiceRegistry reg = registry(args);
  ServiceRegistry::check_name(args.name);
  const std::optional<ServiceRecord> record = reg.find(args.name);
  const fs::path log = record ? record->log : reg.log_path(args.name);
  LOOM_CHECK(fs::exists(log), InvalidArgument, reg.unknown(args.name));
  std::string text = util::read_file(log);
  size_t offset = text.size();
  if (args.tail >= 0) {
    size_t at = text.size();
    if (at > 0 && text[at - 1] == '\n') --at;
    for (int n = 0; n < args.tail && at != std::string::npos && at > 0; ++n) {
      at = at == 0 ? std::string::npos : text.rfind('\n', at - 1);
    }
    text = args.tail == 0 ? "" : at == std::string::npos ? text : text.substr(at + 1);
  }
  std::cout << text << std::flush;
  if (!args.follow || !record) return kExitOk;
  // Until the service is gone (then what it wrote last), or Ctrl-C.
  for (bool last = false; !last;) {
    last = !ServiceRegistry::alive(*record);
    if (!last) std::this_thread::sleep_for(std::chrono::milliseconds(200));
    const std::string now = util::read_file(log);
    if (now.size() > offset) std::cout << now.substr(offset) << std::flush;
    offset = std::max(offset, now.size());
  }
  return kExitOk;
}

int stop(const ServiceArgs& args) {
  ServiceRegistry reg = registry(args);
  ServiceRegistry::check_name(args.name);
  const std::optional<ServiceRecord> record = reg.find(args.name);
  const bool was_running =
      reg.stop(args.name, std::chrono::milliseconds(static_cast<int64_t>(args.grace_s * 1000)));
  if (was_running) {
    std::cout << "stopped " << args.name << " (pid " << record->pid << ")\n";
  } else {
    std::cout << args.name << " was not running (pid " << record->pid
              << " is gone); removed its record\n";
  }
  return kExitOk;
}

}  // namespace

void register_service(CLI::App& app, Action& action) {
  auto args = std::make_shared<ServiceArgs>();
  CLI::App* service = app.add_subcommand(
      "service", "Long-lived services that outlive a job; later jobs attach to them by name.");
  service->require_subcommand(1);
  service->footer(
      "The services' records (one per name) and logs are kept in --dir: $LOOM_SERVICES_DIR, else\n"
      "~/.loom/services, else /tmp/loom-services-<uid>. A job spec's group with scope =\n"
      "\"long-lived\" uses the same directory: it attaches to a running service of its name or\n"
      "starts one, and never stops it. docs/launcher.md, \"Long-lived services\".");
  const auto add_dir = [&](CLI::App* cmd) {
    cmd->add_option("--dir", args->dir,
                    "the services' directory (default: $LOOM_SERVICES_DIR, else ~/.loom/services, "
                    "else /tmp/loom-services-<uid>)");
  };

  CLI::App* start_cmd = service->add_subcommand(
      "start", "Start a service in the background and wait until it is ready.");
  start_cmd->add_option("name", args->name, "the service's name: later jobs attach by it")
      ->required();
  start_cmd->add_option("command", args->command, "the program and its arguments (after --)");
  start_cmd
      ->add_option("--port", args->port,
                   "the port it listens on: its endpoint 127.0.0.1:PORT, and {port} in "
                   "the command")
      ->check(CLI::Range(1, 65535));
  start_cmd->add_option("--health", args->health,
                        "readiness: tcp (the port accepts a connection; the default with --port), "
                        "http:/PATH (answers 2xx) or none (started)");
  start_cmd
      ->add_option("--ready-timeout", args->ready_timeout_s,
                   "seconds to wait for readiness; then the service is killed")
      ->capture_default_str();
  start_cmd->add_option("--env", args->env, "KEY=VALUE for its environment (repeatable)");
  add_dir(start_cmd);
  start_cmd->footer(
      "It runs in its own session (setsid), stdin from /dev/null, output appended to\n"
      "<dir>/NAME.log, and gets LOOM_SERVICE_NAME. An error when NAME runs already; a dead\n"
      "record of NAME is replaced.\n"
      "Example: loom service start files --port 7000 -- python3 -m http.server {port}");
  start_cmd->callback([args, &action] { action = [args] { return start(*args); }; });

  CLI::App* ls_cmd = service->add_subcommand("ls", "List the services: alive or dead.");
  ls_cmd->add_flag("--json", args->json, "as JSON, one object per service");
  add_dir(ls_cmd);
  ls_cmd->footer(
      "Columns: NAME, PID, STATE (alive, or dead: the process is gone; `loom service stop` or\n"
      "`start` clears its record), ENDPOINT, UPTIME and COMMAND.");
  ls_cmd->callback([args, &action] { action = [args] { return ls(*args); }; });

  CLI::App* logs_cmd = service->add_subcommand("logs", "Print a service's log.");
  logs_cmd->add_option("name", args->name, "the service")->required();
  logs_cmd->add_flag("-f,--follow", args->follow,
                     "then print what it writes until it exits (or Ctrl-C)");
  logs_cmd->add_option("--tail", args->tail, "only the last N lines")
      ->check(CLI::Range(0, 1 << 30));
  add_dir(logs_cmd);
  logs_cmd->footer("Each start appends a \"---- start <time> ----\" line before its output.");
  logs_cmd->callback([args, &action] { action = [args] { return logs(*args); }; });

  CLI::App* stop_cmd = service->add_subcommand("stop", "Stop a service and remove its record.");
  stop_cmd->add_option("name", args->name, "the service")->required();
  stop_cmd
      ->add_option("--grace", args->grace_s,
                   "seconds between SIGTERM (to its process group) and SIGKILL")
      ->capture_default_str();
  add_dir(stop_cmd);
  stop_cmd->footer(
      "A service that died already has its record removed (exit code 0). Its log is kept.");
  stop_cmd->callback([args, &action] { action = [args] { return stop(*args); }; });
}

}  // namespace loom::cli
