// A child process owned by RAII: spawn with extra environment and captured output, wait
// with a deadline, signal, and on destruction kill and reap whatever is still running.
// Used by the test harness, the launcher and integration tests. Private to Loom.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace loom::util {

// How a child ended: an exit code or a signal.
struct ExitStatus {
  int code = -1;   // exit code when exited normally, else -1
  int signal = 0;  // terminating signal, else 0
  bool ok() const { return signal == 0 && code == 0; }
  // "exited with code 3", "killed by signal 9 (Killed)".
  std::string describe() const;
};

struct SubprocessOptions {
  std::vector<std::string> argv;                // argv[0] is the program; PATH is searched
  std::map<std::string, std::string> env;       // added to (or replacing in) the parent's env
  std::optional<std::filesystem::path> output;  // stdout+stderr appended here; else inherited
  int output_fd = -1;  // when >= 0 (and no output): stdout+stderr go to this fd, e.g. a pipe
  std::optional<std::filesystem::path> cwd;  // working directory; else the parent's
  bool own_process_group = true;             // signals then reach the child's children too
};

// Not copyable; movable. Not thread-safe: one owner drives it.
class Subprocess {
 public:
  // Starts the child (posix_spawn: safe in a multi-threaded parent). A program that cannot be
  // started is IoError naming it.
  static Subprocess spawn(const SubprocessOptions& options);

  Subprocess(Subprocess&& other) noexcept;
  Subprocess& operator=(Subprocess&& other) noexcept;
  Subprocess(const Subprocess&) = delete;
  Subprocess& operator=(const Subprocess&) = delete;
  // Kills (SIGKILL, whole process group when it has one) and reaps a child still running.
  ~Subprocess();

  pid_t pid() const { return pid_; }
  bool running();
  // Waits up to timeout; the status when the child ended, nullopt when still running.
  std::optional<ExitStatus> wait_for(std::chrono::milliseconds timeout);
  // Waits without limit.
  ExitStatus wait();
  // Sends sig to the child (and its process group when it owns one). No-op once reaped.
  void signal(int sig);

 private:
  explicit Subprocess(pid_t pid, bool group) : pid_(pid), group_(group) {}
  void reap_blocking();

  pid_t pid_ = -1;
  bool group_ = false;
  std::optional<ExitStatus> status_;
};

// One process per rank, for jobs started by hand rather than by `loom run`: the test harness's
// run_processes and the benchmarks' workers.
struct RankProcessesOptions {
  // From the start: ranks still running then are killed.
  std::chrono::milliseconds timeout = std::chrono::hours(24);
  // Once a rank has failed, the others' time left (they are usually waiting for it in a
  // collective that would time out much later): then they are killed.
  std::chrono::milliseconds after_failure = std::chrono::hours(24);
};

// Spawns `world` processes, rank r's from options_for(r), and waits for all of them. Rank r's
// result is its exit status, or nullopt when it was still running at the timeout (or
// after_failure past the first failure) and was killed here.
std::vector<std::optional<ExitStatus>> run_rank_processes(
    int world, const std::function<SubprocessOptions(int rank)>& options_for,
    const RankProcessesOptions& options = {});

// The pids of `parent`'s living children now (read from /proc): e.g. the workers of a `loom run`
// agent, for a test or a benchmark to kill one of them, or all of them with the agent.
std::vector<pid_t> child_pids(pid_t parent);

}  // namespace loom::util
