// Services beside the training workers (services.h).
#include "control/services.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <csignal>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "loom/error.h"
#include "util/deadline.h"
#include "util/files.h"

namespace loom::control {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// Connects to 127.0.0.1:port within `timeout`; the socket (>= 0) or -1.
int connect_local(int port, milliseconds timeout) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  timeval tv{static_cast<time_t>(timeout.count() / 1000),
             static_cast<suseconds_t>((timeout.count() % 1000) * 1000)};
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// Whether the health check passes now.
bool healthy(const Health& health) {
  switch (health.kind) {
    case Health::Kind::kNone:
    case Health::Kind::kHeartbeat:  // readiness is "started"; heartbeats are for liveness
      return true;
    case Health::Kind::kTcp: {
      const int fd = connect_local(health.port, milliseconds(500));
      if (fd < 0) return false;
      ::close(fd);
      return true;
    }
    case Health::Kind::kHttp: {
      const int fd = connect_local(health.port, milliseconds(500));
      if (fd < 0) return false;
      const std::string request =
          "GET " + health.path + " HTTP/1.0\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
      bool ok = ::send(fd, request.data(), request.size(), MSG_NOSIGNAL) ==
                static_cast<ssize_t>(request.size());
      char reply[64] = {};
      ok = ok && ::recv(fd, reply, sizeof reply - 1, 0) >= 12;
      ::close(fd);
      // "HTTP/1.x 2xx"
      return ok && std::strncmp(reply, "HTTP/1.", 7) == 0 && reply[9] == '2';
    }
  }
  return false;
}

std::string describe(const Health& health) {
  switch (health.kind) {
    case Health::Kind::kNone:
      return "started";
    case Health::Kind::kHeartbeat:
      return "started (heartbeats)";
    case Health::Kind::kTcp:
      return detail::concat("tcp port ", health.port);
    case Health::Kind::kHttp:
      return detail::concat("http :", health.port, health.path, " answering 2xx");
  }
  return "?";
}

// LOOM_SERVICE_DATA_CACHE for "data-cache".
std::string env_name(const std::string& service) {
  std::string out = "LOOM_SERVICE_";
  for (char c : service) {
    out += std::isalnum(static_cast<unsigned char>(c)) ? static_cast<char>(std::toupper(c)) : '_';
  }
  return out;
}

}  // namespace

struct ServiceSupervisor::Process {
  GroupSpec group;
  int replica = 0;
  std::optional<util::Subprocess> process;
  std::optional<util::ExitStatus> last_exit;  // of the current process, once it exited
  std::string exited;                         // how the last process that exited ended
  int restarts = 0;
  Clock::time_point restart_at{};  // when a pending restart may start
  bool down = false;               // not restarted after a failure: the job fails
  bool done = false;               // exited cleanly and not restarted (restart on-failure/never)
  bool stopped = false;            // stopped by stop(), at the end of the job
  std::string name() const { return detail::concat(group.name, "/", replica); }
};

ServiceSupervisor::ServiceSupervisor(const JobSpec& spec, int node, std::filesystem::path run_dir,
                                     std::string host, Publish publish, Say say)
    : node_(node),
      run_dir_(std::move(run_dir)),
      host_(std::move(host)),
      publish_(std::move(publish)),
      say_(std::move(say)) {
  for (const auto& [name, replica] : spec.processes_on(node)) {
    const GroupSpec& group = *spec.find(name);
    if (group.training) continue;
    Process p;
    p.group = group;
    p.replica = replica;
    processes_.push_back(std::move(p));
  }
  std::filesystem::create_directories(run_dir_ / "logs");
}

ServiceSupervisor::~ServiceSupervisor() = default;  // ~Subprocess kills what still runs

void ServiceSupervisor::launch(Process& p) {
  std::map<std::string, std::string> env = p.group.env;
  env["LOOM_SERVICE_NAME"] = p.group.name;
  env["LOOM_SERVICE_REPLICA"] = std::to_string(p.replica);
  env["LOOM_RUN_DIR"] = run_dir_.string();
  const auto log = run_dir_ / "logs" / detail::concat(p.group.name, "_", p.replica, ".out");
  {
    std::ofstream out(log, std::ios::app);
    out << "---- start " << p.restarts + 1 << " ----\n";
  }
  p.process = util::Subprocess::spawn({.argv = p.group.command, .env = env, .output = log});
  p.last_exit.reset();
}

void ServiceSupervisor::wait_ready(Process& p) {
  const auto timeout = milliseconds(static_cast<int64_t>(p.group.ready_timeout_seconds * 1000));
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    if (const auto status = p.process->wait_for(milliseconds(0))) {
      throw Error(detail::concat("service ", p.name(), " (", p.group.command.front(), ") ",
                                 status->describe(), " before it was ready; see <run-dir>/logs/",
                                 p.group.name, "_", p.replica, ".out"));
    }
    if (healthy(p.group.health)) break;
    LOOM_CHECK(!util::expired(deadline), Timeout, "service ", p.name(), " was not ready within ",
               p.group.ready_timeout_seconds, " s (health: ", describe(p.group.health),
               "); raise ready_timeout_seconds or see <run-dir>/logs/", p.group.name, "_",
               p.replica, ".out");
    std::this_thread::sleep_for(milliseconds(100));
  }
  const int port = p.group.health.port;
  publish_(detail::concat("services/", p.group.name, "/", p.replica),
           port > 0 ? detail::concat(host_, ":", port) : host_);
}

void ServiceSupervisor::start() {
  for (Process& p : processes_) {
    launch(p);
    wait_ready(p);
    say_(detail::concat("service ", p.name(), " ready (pid ", p.process->pid(), ", ",
                        describe(p.group.health), ")"));
  }
  write_state();
}

std::optional<std::string> ServiceSupervisor::poll() {
  bool changed = false;
  for (Process& p : processes_) {
    if (p.down || p.done) continue;
    if (p.process && !p.last_exit) {
      const auto status = p.process->wait_for(milliseconds(0));
      if (!status) continue;
      p.last_exit = status;
      p.exited = status->describe();
      changed = true;
      const bool restart = p.group.restart == RestartPolicy::kAlways ||
                           (p.group.restart == RestartPolicy::kOnFailure && !status->ok());
      if (!restart) {
        if (status->ok()) {
          say_(detail::concat("service ", p.name(), " exited with code 0; not restarted (restart ",
                              to_string(p.group.restart), ")"));
          p.done = true;
          continue;
        }
        p.down = true;
        write_state();
        return detail::concat("service ", p.name(), " ", status->describe(), " (restart never)");
      }
      if (p.restarts >= p.group.max_restarts) {
        p.down = true;
        write_state();
        return detail::concat("service ", p.name(), " ", status->describe(), " and has used its ",
                              p.group.max_restarts, " restart(s) (max_restarts)");
      }
      // Exponential backoff from backoff_seconds, doubling with each restart.
      const double backoff =
          p.group.backoff_seconds * static_cast<double>(1 << std::min(p.restarts, 10));
      p.restart_at = Clock::now() + milliseconds(static_cast<int64_t>(backoff * 1000));
      say_(detail::concat("service ", p.name(), " ", status->describe(), "; restarting it in ",
                          backoff, " s (", p.restarts + 1, " of ", p.group.max_restarts, ")"));
    }
    if (p.last_exit && Clock::now() >= p.restart_at) {
      ++p.restarts;
      launch(p);
      try {
        wait_ready(p);
      } catch (const Error& e) {
        p.down = true;
        write_state();
        return detail::concat("restarting ", e.what());
      }
      say_(detail::concat("service ", p.name(), " restarted and ready (pid ", p.process->pid(),
                          ")"));
      changed = true;
    }
  }
  if (changed) write_state();
  return std::nullopt;
}

void ServiceSupervisor::stop(milliseconds grace) {
  for (auto it = processes_.rbegin(); it != processes_.rend(); ++it) {
    it->stopped = true;
    if (it->process && !it->last_exit) it->process->signal(SIGTERM);
  }
  const auto deadline = Clock::now() + grace;
  for (auto it = processes_.rbegin(); it != processes_.rend(); ++it) {
    if (!it->process || it->last_exit) continue;
    it->last_exit = it->process->wait_for(util::time_left(deadline));
    if (it->last_exit) it->exited = it->last_exit->describe();
    if (!it->last_exit) {
      say_(detail::concat("service ", it->name(), " did not stop within ", grace.count(),
                          " ms: SIGKILL"));
      it->process->signal(SIGKILL);
      it->last_exit = it->process->wait();
      it->exited = it->last_exit->describe();
    }
  }
  write_state();
}

std::map<std::string, std::string> ServiceSupervisor::env() const {
  std::map<std::string, std::string> out;
  for (const Process& p : processes_) {
    const int port = p.group.health.port;
    std::string& value = out[env_name(p.group.name)];
    value += (value.empty() ? "" : ",") + (port > 0 ? detail::concat(host_, ":", port) : host_);
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
    const bool running = p.process && !p.last_exit;
    out.push_back({{"service", p.group.name},
                   {"replica", p.replica},
                   {"node", node_},
                   {"pid", running ? p.process->pid() : 0},
                   {"state", p.down      ? "down"
                             : p.stopped ? "stopped"
                             : p.done    ? "exited"
                             : running   ? "running"
                                         : "restarting"},
                   {"restarts", p.restarts},
                   {"last_exit", p.exited},
                   {"health", describe(p.group.health)}});
  }
  try {
    util::write_file_atomic(run_dir_ / detail::concat("services_node", node_, ".json"),
                            out.dump(1) + "\n", util::Durability::kAtomicOnly);
  } catch (const Error& e) {
    say_(detail::concat("cannot write the services' state: ", e.what()));
  }
}

}  // namespace loom::control
