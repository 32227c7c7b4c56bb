// The registry of long-lived services (service_registry.h): records, daemonized starts,
// liveness from /proc, stops.
#include "control/service_registry.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "control/health.h"
#include "loom/error.h"
#include "util/deadline.h"
#include "util/fd.h"
#include "util/files.h"

namespace loom::control {
namespace {

using Clock = std::chrono::steady_clock;
using detail::concat;
using std::chrono::milliseconds;
namespace fs = std::filesystem;

// The state letter and starttime of /proc/<pid>/stat; nullopt when there is no such process.
std::optional<std::pair<char, uint64_t>> proc_stat(pid_t pid) {
  std::ifstream in(concat("/proc/", pid, "/stat"));
  std::string text;
  if (!in || !std::getline(in, text)) return std::nullopt;
  const auto paren = text.rfind(')');  // the command name may hold spaces and parentheses
  if (paren == std::string::npos) return std::nullopt;
  std::istringstream fields(text.substr(paren + 1));
  char state = '?';
  fields >> state;
  std::string field;
  for (int i = 4; i < 22; ++i) fields >> field;  // fields 4..21
  uint64_t start = 0;
  fields >> start;  // field 22: starttime, in clock ticks since boot
  if (!fields) return std::nullopt;
  return std::make_pair(state, start);
}

int64_t now_unix_ms() {
  return std::chrono::duration_cast<milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// The program `name` names: itself when it holds a '/', else the first executable in $PATH.
std::string resolve_program(const std::string& name) {
  if (name.find('/') != std::string::npos) return name;
  const char* path = std::getenv("PATH");
  std::istringstream dirs(path != nullptr ? path : "/usr/local/bin:/usr/bin:/bin");
  for (std::string dir; std::getline(dirs, dir, ':');) {
    const std::string candidate = (dir.empty() ? "." : dir) + "/" + name;
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  throw IoError(concat("cannot start '", name, "': not found in $PATH"));
}

// Holds <dir>/<name>.lock exclusively while it lives: one start or stop of a name at a time.
class NameLock {
 public:
  NameLock(const fs::path& dir, const std::string& name)
      : fd_(::open((dir / (name + ".lock")).c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644)) {
    LOOM_CHECK_SYS(fd_.get(), "opening the lock of service ", name, " in ", dir.string());
    while (::flock(fd_.get(), LOCK_EX) != 0) {
      LOOM_CHECK_SYS(errno == EINTR ? 0 : -1, "locking service ", name, " in ", dir.string());
    }
  }

 private:
  util::UniqueFd fd_;
};

// Starts `argv` as a daemon: its own session and process group, stdin /dev/null, stdout and
// stderr appended to `log`, never this process's child (the intermediate child that forks it
// exits at once). Only async-signal-safe calls between fork and exec. Returns its pid; IoError
// when it cannot be executed.
pid_t spawn_daemon(const std::vector<std::string>& argv,
                   const std::map<std::string, std::string>& extra_env, const fs::path& log) {
  const std::string program = resolve_program(argv.front());
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  std::vector<std::string> env_text;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string var = *e;
    if (extra_env.count(var.substr(0, var.find('='))) == 0) env_text.push_back(var);
  }
  for (const auto& [key, value] : extra_env) env_text.push_back(key + "=" + value);
  std::vector<char*> envp;
  for (const std::string& e : env_text) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  const std::string log_text = log.string();

  int fds[2];
  LOOM_CHECK_SYS(::pipe2(fds, O_CLOEXEC), "creating a pipe to start service ", argv.front());
  util::UniqueFd read_end(fds[0]);
  util::UniqueFd write_end(fds[1]);
  const pid_t middle = ::fork();
  LOOM_CHECK_SYS(middle, "forking to start service ", argv.front());
  if (middle == 0) {
    ::setsid();
    const pid_t pid = ::fork();
    if (pid != 0) {  // the intermediate child: report the daemon's pid (or -errno), exit
      const int32_t message = pid > 0 ? pid : -errno;
      (void)!::write(fds[1], &message, sizeof message);
      ::_exit(0);
    }
    ::setpgid(0, 0);
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    const int in = ::open("/dev/null", O_RDONLY);
    const int out = ::open(log_text.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (in < 0 || out < 0 || ::dup2(in, 0) < 0 || ::dup2(out, 1) < 0 || ::dup2(out, 2) < 0) {
      const int32_t err = errno;
      (void)!::write(fds[1], &err, sizeof err);
      ::_exit(127);
    }
    // Every other descriptor the starter had open (sockets of a job's agent) closes at exec.
    ::syscall(SYS_close_range, 3U, ~0U, 4U /* CLOSE_RANGE_CLOEXEC */);
    ::execve(program.c_str(), args.data(), envp.data());
    const int32_t err = errno;
    (void)!::write(fds[1], &err, sizeof err);
    ::_exit(127);
  }
  write_end.reset();
  int status = 0;
  while (::waitpid(middle, &status, 0) < 0 && errno == EINTR) {
  }
  int32_t pid = 0;
  int32_t err = 0;
  const ssize_t got = ::read(read_end.get(), &pid, sizeof pid);
  LOOM_CHECK(got == sizeof pid && pid > 0, IoError, "cannot start service ", argv.front(),
             ": fork failed (", std::strerror(got == sizeof pid ? -pid : errno), ")");
  if (::read(read_end.get(), &err, sizeof err) == sizeof err) {
    throw IoError(concat("cannot start '", program, "': ", std::strerror(err)));
  }
  return pid;
}

// The last `lines` lines of the log since its last "---- start" line, indented.
std::string log_tail(const fs::path& log, size_t lines) {
  std::string text;
  try {
    text = util::read_file(log);
  } catch (const Error&) {
    return "";
  }
  const auto start = text.rfind("---- start ");
  if (start != std::string::npos) text = text.substr(text.find('\n', start) + 1);
  std::vector<std::string> all;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) all.push_back(line);
  std::string out;
  for (size_t i = all.size() > lines ? all.size() - lines : 0; i < all.size(); ++i)
    out += "\n  | " + all[i];
  return out;
}

std::string local_time(int64_t unix_ms) {
  const std::time_t t = static_cast<std::time_t>(unix_ms / 1000);
  std::tm tm{};
  ::localtime_r(&t, &tm);
  char text[32];
  std::strftime(text, sizeof text, "%Y-%m-%d %H:%M:%S", &tm);
  return text;
}

nlohmann::json to_json(const ServiceRecord& r) {
  return {{"name", r.name},
          {"command", r.command},
          {"pid", r.pid},
          {"proc_start", r.proc_start},
          {"started_unix_ms", r.started_unix_ms},
          {"port", r.port},
          {"health", r.health},
          {"log", r.log.string()},
          {"cwd", r.cwd.string()}};
}

}  // namespace

std::string ServiceRecord::endpoint() const {
  return port > 0 ? concat("127.0.0.1:", port) : std::string();
}

fs::path ServiceRegistry::default_dir() {
  if (const char* dir = std::getenv("LOOM_SERVICES_DIR"); dir != nullptr && *dir != '\0')
    return dir;
  if (const char* home = std::getenv("HOME"); home != nullptr && *home != '\0')
    return fs::path(home) / ".loom" / "services";
  return concat("/tmp/loom-services-", ::getuid());
}

ServiceRegistry::ServiceRegistry(fs::path dir) : dir_(std::move(dir)) {
  util::create_directories(dir_, "the services' directory",
                           "give another with --dir or $LOOM_SERVICES_DIR");
}

void ServiceRegistry::check_name(const std::string& name) {
  const bool ok = !name.empty() && name.size() <= 200 && name.front() != '.' &&
                  std::all_of(name.begin(), name.end(), [](char c) {
                    return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' ||
                           c == '@' || c == '-';
                  });
  LOOM_CHECK(ok, InvalidArgument, "service name '", name,
             "' is not letters, digits, '.', '_', '@' and '-' (not starting with '.')");
}

std::vector<ServiceRecord> ServiceRegistry::list() const {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir_)) {
    if (entry.path().extension() == ".json") names.push_back(entry.path().stem().string());
  }
  std::sort(names.begin(), names.end());
  std::vector<ServiceRecord> out;
  for (const std::string& name : names) {
    if (auto record = find(name)) out.push_back(std::move(*record));
  }
  return out;
}

std::optional<ServiceRecord> ServiceRegistry::find(const std::string& name) const {
  const fs::path path = record_path(name);
  std::string text;
  try {
    text = util::read_file(path);
  } catch (const IoError&) {
    if (!fs::exists(path)) return std::nullopt;
    throw;
  }
  try {
    const nlohmann::json j = nlohmann::json::parse(text);
    ServiceRecord r;
    r.name = j.at("name").get<std::string>();
    r.command = j.at("command").get<std::vector<std::string>>();
    r.pid = j.at("pid").get<pid_t>();
    r.proc_start = j.at("proc_start").get<uint64_t>();
    r.started_unix_ms = j.at("started_unix_ms").get<int64_t>();
    r.port = j.at("port").get<int>();
    r.health = j.at("health").get<std::string>();
    r.log = j.at("log").get<std::string>();
    r.cwd = j.at("cwd").get<std::string>();
    return r;
  } catch (const nlohmann::json::exception& e) {
    throw CorruptData(concat("service record ", path.string(), " is malformed (", e.what(),
                             "); remove it if the service is gone"));
  }
}

bool ServiceRegistry::alive(const ServiceRecord& record) {
  if (record.pid <= 0) return false;
  const auto stat = proc_stat(record.pid);
  return stat && stat->first != 'Z' && stat->first != 'X' && stat->second == record.proc_start;
}

void ServiceRegistry::write(const ServiceRecord& record) const {
  util::write_file_atomic(record_path(record.name), to_json(record).dump(1) + "\n",
                          util::Durability::kAtomicOnly);
}

std::string ServiceRegistry::unknown(const std::string& name) const {
  std::string names;
  for (const ServiceRecord& r : list()) names += (names.empty() ? "" : ", ") + r.name;
  return concat("no service named '", name, "' in ", dir_.string(),
                " (services there: ", names.empty() ? "none" : names, ")");
}

ServiceRegistry::Started ServiceRegistry::start(const ServiceStartOptions& options, bool attach) {
  check_name(options.name);
  LOOM_CHECK(!options.command.empty(), InvalidArgument, "service ", options.name,
             ": no command to run");
  NameLock lock(dir_, options.name);
  if (std::optional<ServiceRecord> old = find(options.name)) {
    if (alive(*old)) {
      if (attach) return {*old, true};
      throw Error(concat("service ", options.name, " is already running (pid ", old->pid,
                         ", since ", local_time(old->started_unix_ms), "); `loom service stop ",
                         options.name, "` first, or pick another name"));
    }
  }
  ServiceRecord r;
  r.name = options.name;
  r.command = options.command;
  r.port = options.health.port;
  r.health = describe(options.health);
  r.log = fs::absolute(log_path(options.name));
  r.cwd = fs::current_path();
  {
    std::ofstream out(r.log, std::ios::app);
    out << "---- start " << local_time(now_unix_ms()) << " ----\n";
  }
  r.pid = spawn_daemon(options.command, options.env, r.log);
  r.started_unix_ms = now_unix_ms();
  if (const auto stat = proc_stat(r.pid)) r.proc_start = stat->second;
  write(r);
  const auto deadline = Clock::now() + options.ready_timeout;
  for (;;) {
    if (!alive(r)) {
      fs::remove(record_path(r.name));
      throw Error(concat("service ", r.name, " (", r.command.front(),
                         ") exited before it was ready; the end of its log ", r.log.string(), ":",
                         log_tail(r.log, 5)));
    }
    if (healthy(options.health)) return {r, false};
    if (util::expired(deadline)) {
      ::kill(-r.pid, SIGKILL);
      fs::remove(record_path(r.name));
      throw Timeout(concat("service ", r.name, " was not ready within ",
                           options.ready_timeout.count() / 1000.0, " s (health: ", r.health,
                           "); it was killed; see its log ", r.log.string()));
    }
    std::this_thread::sleep_for(milliseconds(50));
  }
}

bool ServiceRegistry::stop(const std::string& name, milliseconds grace) {
  check_name(name);
  NameLock lock(dir_, name);
  const std::optional<ServiceRecord> r = find(name);
  LOOM_CHECK(r.has_value(), InvalidArgument, unknown(name));
  if (!alive(*r)) {
    fs::remove(record_path(name));
    return false;
  }
  const auto signal_group = [&](int sig) {
    if (::kill(-r->pid, sig) != 0) ::kill(r->pid, sig);  // its group, else itself
  };
  signal_group(SIGTERM);
  for (const auto deadline = Clock::now() + grace; alive(*r) && !util::expired(deadline);) {
    std::this_thread::sleep_for(milliseconds(20));
  }
  if (alive(*r)) {
    signal_group(SIGKILL);
    for (const auto deadline = Clock::now() + std::chrono::seconds(5);
         alive(*r) && !util::expired(deadline);) {
      std::this_thread::sleep_for(milliseconds(20));
    }
    LOOM_CHECK(!alive(*r), Error, "service ", name, " (pid ", r->pid,
               ") is still alive 5 s after SIGKILL; its record is kept");
  }
  fs::remove(record_path(name));
  return true;
}

}  // namespace loom::control
