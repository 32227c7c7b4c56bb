// Subprocess: posix_spawnp with redirected output, an optional own process group, and a
// destructor that kills and reaps, so no test or launcher leaks a child.

#include "util/subprocess.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>
#include <utility>

#include "loom/error.h"
#include "util/deadline.h"

extern char** environ;

namespace loom::util {
namespace {

using Clock = std::chrono::steady_clock;

ExitStatus decode(int wait_status) {
  ExitStatus status;
  if (WIFEXITED(wait_status)) status.code = WEXITSTATUS(wait_status);
  if (WIFSIGNALED(wait_status)) status.signal = WTERMSIG(wait_status);
  return status;
}

// The parent's environment with options.env applied, as "NAME=value" strings.
std::vector<std::string> child_environment(const std::map<std::string, std::string>& overrides) {
  std::vector<std::string> result;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    const std::string item = *entry;
    const std::string name = item.substr(0, item.find('='));
    if (overrides.count(name) == 0) result.push_back(item);
  }
  for (const auto& [name, value] : overrides) result.push_back(name + "=" + value);
  return result;
}

std::vector<char*> c_strings(std::vector<std::string>& strings) {
  std::vector<char*> result;
  for (std::string& s : strings) result.push_back(s.data());
  result.push_back(nullptr);
  return result;
}

// posix_spawn's C structures, destroyed on every path out of spawn().
class SpawnSetup {
 public:
  SpawnSetup() {
    ::posix_spawn_file_actions_init(&actions_);
    ::posix_spawnattr_init(&attr_);
  }
  ~SpawnSetup() {
    ::posix_spawn_file_actions_destroy(&actions_);
    ::posix_spawnattr_destroy(&attr_);
  }
  SpawnSetup(const SpawnSetup&) = delete;
  SpawnSetup& operator=(const SpawnSetup&) = delete;

  posix_spawn_file_actions_t* actions() { return &actions_; }
  posix_spawnattr_t* attr() { return &attr_; }

 private:
  posix_spawn_file_actions_t actions_;
  posix_spawnattr_t attr_;
};

// The posix_spawn family returns an error number rather than setting errno.
void check_spawn(int err, const char* call, const std::string& program, const char* file,
                 int line) {
  if (err != 0) detail::throw_system_error(err, call, "starting '" + program + "'", file, line);
}
#define LOOM_CHECK_SPAWN(call, program) check_spawn((call), #call, program, __FILE__, __LINE__)

}  // namespace

std::string ExitStatus::describe() const {
  if (signal != 0) {
    return detail::concat("killed by signal ", signal, " (", ::sigdescr_np(signal), ")");
  }
  return detail::concat("exited with code ", code);
}

Subprocess Subprocess::spawn(const SubprocessOptions& options) {
  LOOM_CHECK(!options.argv.empty(), InvalidArgument, "Subprocess::spawn: argv is empty");
  const std::string& program = options.argv.front();
  SpawnSetup setup;
  if (options.output) {
    // Opened before the chdir, so a relative output path is relative to the parent's cwd.
    LOOM_CHECK_SPAWN(
        ::posix_spawn_file_actions_addopen(setup.actions(), STDOUT_FILENO, options.output->c_str(),
                                           O_WRONLY | O_CREAT | O_APPEND, 0644),
        program);
    LOOM_CHECK_SPAWN(
        ::posix_spawn_file_actions_adddup2(setup.actions(), STDOUT_FILENO, STDERR_FILENO), program);
  }
  if (options.output_fd >= 0) {
    LOOM_CHECK_SPAWN(
        ::posix_spawn_file_actions_adddup2(setup.actions(), options.output_fd, STDOUT_FILENO),
        program);
    LOOM_CHECK_SPAWN(
        ::posix_spawn_file_actions_adddup2(setup.actions(), STDOUT_FILENO, STDERR_FILENO), program);
  }
  if (options.cwd) {
    LOOM_CHECK_SPAWN(::posix_spawn_file_actions_addchdir_np(setup.actions(), options.cwd->c_str()),
                     program);
  }
  // The child starts with no blocked signals and default dispositions whatever the spawning
  // thread had (a parent ignoring SIGPIPE must not pass that on).
  sigset_t no_signals;
  sigset_t all_signals;
  sigemptyset(&no_signals);
  sigfillset(&all_signals);
  short flags = POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF;
  if (options.own_process_group) flags |= POSIX_SPAWN_SETPGROUP;
  LOOM_CHECK_SPAWN(::posix_spawnattr_setflags(setup.attr(), flags), program);
  LOOM_CHECK_SPAWN(::posix_spawnattr_setsigmask(setup.attr(), &no_signals), program);
  LOOM_CHECK_SPAWN(::posix_spawnattr_setsigdefault(setup.attr(), &all_signals), program);
  LOOM_CHECK_SPAWN(::posix_spawnattr_setpgroup(setup.attr(), 0), program);

  std::vector<std::string> argv_strings = options.argv;
  std::vector<std::string> env_strings = child_environment(options.env);
  std::vector<char*> argv = c_strings(argv_strings);
  std::vector<char*> envp = c_strings(env_strings);
  pid_t pid = -1;
  LOOM_CHECK_SPAWN(::posix_spawnp(&pid, program.c_str(), setup.actions(), setup.attr(), argv.data(),
                                  envp.data()),
                   program);
  return Subprocess(pid, options.own_process_group);
}

Subprocess::Subprocess(Subprocess&& other) noexcept
    : pid_(std::exchange(other.pid_, -1)),
      group_(other.group_),
      status_(std::exchange(other.status_, std::nullopt)) {}

Subprocess& Subprocess::operator=(Subprocess&& other) noexcept {
  if (this != &other) {
    Subprocess doomed(std::move(*this));  // kills and reaps what this held
    pid_ = std::exchange(other.pid_, -1);
    group_ = other.group_;
    status_ = std::exchange(other.status_, std::nullopt);
  }
  return *this;
}

Subprocess::~Subprocess() {
  if (pid_ <= 0 || status_) return;
  // The unreaped child pins its pid, so -pid_ still names its own group here. Once reaped, the
  // pid could be reused by an unrelated group leader, so a reaped child's group is left alone.
  ::kill(group_ ? -pid_ : pid_, SIGKILL);
  try {
    reap_blocking();
  } catch (const Error&) {
    // Already reaped elsewhere (SIGCHLD set to SIG_IGN, say): nothing is left to clean up.
  }
}

bool Subprocess::running() { return !wait_for(std::chrono::milliseconds{0}).has_value(); }

std::optional<ExitStatus> Subprocess::wait_for(std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  std::chrono::milliseconds backoff{1};
  while (!status_) {
    int wait_status = 0;
    const pid_t done =
        LOOM_CHECK_SYS(::waitpid(pid_, &wait_status, WNOHANG), "waiting for pid ", pid_);
    if (done == pid_) {
      status_ = decode(wait_status);
      break;
    }
    const auto now = Clock::now();
    if (now >= deadline) break;
    std::this_thread::sleep_for(std::min<Clock::duration>(backoff, deadline - now));
    backoff = std::min(backoff * 2, std::chrono::milliseconds{10});
  }
  return status_;
}

std::vector<std::optional<ExitStatus>> run_rank_processes(
    int world, const std::function<SubprocessOptions(int rank)>& options_for,
    const RankProcessesOptions& options) {
  std::vector<Subprocess> children;
  for (int r = 0; r < world; ++r) children.push_back(Subprocess::spawn(options_for(r)));
  std::vector<std::optional<ExitStatus>> results(world);
  std::vector<bool> done(world, false);
  auto deadline = deadline_after(options.timeout);
  for (int left = world; left > 0;) {
    for (int r = 0; r < world; ++r) {
      if (done[r]) continue;
      results[r] = children[r].wait_for(std::chrono::milliseconds{0});
      if (!results[r]) continue;
      done[r] = true;
      --left;
      if (!results[r]->ok()) deadline = std::min(deadline, deadline_after(options.after_failure));
    }
    if (left == 0) break;
    if (expired(deadline)) {
      for (int r = 0; r < world; ++r) {
        if (done[r]) continue;
        children[r].signal(SIGKILL);
        children[r].wait();
        results[r].reset();  // killed here, not by its own doing
      }
      break;
    }
    std::this_thread::sleep_for(std::min(std::chrono::milliseconds{10}, time_left(deadline)));
  }
  return results;
}

ExitStatus Subprocess::wait() {
  if (!status_) reap_blocking();
  return *status_;
}

void Subprocess::signal(int sig) {
  if (pid_ <= 0 || status_) return;
  LOOM_CHECK_SYS(::kill(group_ ? -pid_ : pid_, sig), "signalling pid ", pid_);
}

void Subprocess::reap_blocking() {
  int wait_status = 0;
  for (;;) {
    const pid_t done = ::waitpid(pid_, &wait_status, 0);
    if (done == pid_) break;
    if (done == -1 && errno == EINTR) continue;
    LOOM_CHECK_SYS(done, "waiting for pid ", pid_);
  }
  status_ = decode(wait_status);
}

std::vector<pid_t> child_pids(pid_t parent) {
  std::vector<pid_t> out;
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    const std::string name = entry.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream in(entry.path() / "stat");
    const std::string stat((std::istreambuf_iterator<char>(in)), {});
    // "pid (comm) state ppid ...": the command may hold spaces, so fields follow the last ')'.
    const size_t paren = stat.rfind(')');
    if (paren == std::string::npos) continue;
    std::istringstream rest(stat.substr(paren + 1));
    std::string state;
    pid_t ppid = 0;
    if (rest >> state >> ppid && ppid == parent && state != "Z") out.push_back(std::stoi(name));
  }
  return out;
}

}  // namespace loom::util
