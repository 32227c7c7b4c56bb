// Subprocess: exit statuses, captured output, environment and cwd, deadlines, and the
// destructor's kill-and-reap.

#include "util/subprocess.h"

#include <gtest/gtest.h>
#include <signal.h>

#include <cerrno>
#include <fstream>
#include <sstream>
#include <thread>

#include "harness/harness.h"
#include "loom/error.h"

namespace loom::util {
namespace {

using std::chrono::milliseconds;

std::string read_all(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// Running or stopped, as opposed to gone or a zombie.
bool alive(pid_t pid) {
  const std::string stat = read_all("/proc/" + std::to_string(pid) + "/stat");
  const size_t paren = stat.rfind(')');
  if (paren == std::string::npos || paren + 2 >= stat.size()) return false;
  const char state = stat[paren + 2];
  return state != 'Z' && state != 'X';
}

SubprocessOptions command(std::vector<std::string> argv) {
  SubprocessOptions options;
  options.argv = std::move(argv);
  return options;
}

ExitStatus run_shell(const std::string& script) {
  return Subprocess::spawn(command({"sh", "-c", script})).wait();
}

ExitStatus exit_status(int code, int signal) {
  ExitStatus status;
  status.code = code;
  status.signal = signal;
  return status;
}

TEST(ExitStatus, DescribesCodesAndSignals) {
  EXPECT_EQ(exit_status(3, 0).describe(), "exited with code 3");
  EXPECT_EQ(exit_status(-1, 9).describe(), "killed by signal 9 (Killed)");
  EXPECT_TRUE(exit_status(0, 0).ok());
  EXPECT_FALSE(exit_status(3, 0).ok());
  EXPECT_FALSE(exit_status(-1, 15).ok());
}

TEST(Subprocess, ReportsTheExitCode) {
  EXPECT_TRUE(run_shell("exit 0").ok());
  const ExitStatus status = run_shell("exit 7");
  EXPECT_EQ(status.code, 7);
  EXPECT_EQ(status.signal, 0);
  EXPECT_EQ(status.describe(), "exited with code 7");
}

TEST(Subprocess, ReportsTheTerminatingSignal) {
  const ExitStatus status = run_shell("kill -9 $$");
  EXPECT_EQ(status.signal, SIGKILL);
  EXPECT_EQ(status.code, -1);
  EXPECT_EQ(status.describe(), "killed by signal 9 (Killed)");
}

TEST(Subprocess, AppendsStdoutAndStderrToTheOutputFile) {
  loom::testing::TempDir dir;
  const auto log = dir / "out.log";
  { std::ofstream(log) << "earlier\n"; }
  SubprocessOptions options = command({"sh", "-c", "echo to-stdout; echo to-stderr >&2"});
  options.output = log;
  ASSERT_TRUE(Subprocess::spawn(options).wait().ok());
  EXPECT_EQ(read_all(log), "earlier\nto-stdout\nto-stderr\n");
}

TEST(Subprocess, PassesExtraEnvironmentAndKeepsTheParents) {
  loom::testing::TempDir dir;
  ASSERT_EQ(::setenv("LOOM_SUBPROCESS_TEST_INHERITED", "from-parent", 1), 0);
  ASSERT_EQ(::setenv("LOOM_SUBPROCESS_TEST_REPLACED", "old", 1), 0);
  SubprocessOptions options =
      command({"sh", "-c",
               "echo $LOOM_SUBPROCESS_TEST_INHERITED "
               "$LOOM_SUBPROCESS_TEST_REPLACED $LOOM_SUBPROCESS_TEST_ADDED"});
  options.env = {{"LOOM_SUBPROCESS_TEST_REPLACED", "new"}, {"LOOM_SUBPROCESS_TEST_ADDED", "added"}};
  options.output = dir / "out.log";
  ASSERT_TRUE(Subprocess::spawn(options).wait().ok());
  EXPECT_EQ(read_all(dir / "out.log"), "from-parent new added\n");
  ::unsetenv("LOOM_SUBPROCESS_TEST_INHERITED");
  ::unsetenv("LOOM_SUBPROCESS_TEST_REPLACED");
}

TEST(Subprocess, RunsInTheGivenWorkingDirectory) {
  loom::testing::TempDir dir;
  SubprocessOptions options = command({"sh", "-c", "pwd -P"});
  options.output = dir / "out.log";
  options.cwd = dir.path();
  ASSERT_TRUE(Subprocess::spawn(options).wait().ok());
  EXPECT_EQ(read_all(dir / "out.log"), std::filesystem::canonical(dir.path()).string() + "\n");
}

TEST(Subprocess, WaitForTimesOutThenTheDestructorKillsTheChild) {
  pid_t pid = -1;
  {
    Subprocess child = Subprocess::spawn(command({"sleep", "30"}));
    pid = child.pid();
    const auto start = std::chrono::steady_clock::now();
    EXPECT_FALSE(child.wait_for(milliseconds(50)).has_value());
    EXPECT_GE(std::chrono::steady_clock::now() - start, milliseconds(50));
    EXPECT_TRUE(child.running());
    EXPECT_EQ(::kill(pid, 0), 0);
  }
  // Reaped, so the pid no longer names our child.
  EXPECT_EQ(::kill(pid, 0), -1);
  EXPECT_EQ(errno, ESRCH);
}

TEST(Subprocess, TheDestructorKillsTheWholeProcessGroup) {
  loom::testing::TempDir dir;
  pid_t grandchild = -1;
  {
    SubprocessOptions options = command({"sh", "-c", "sleep 30 & echo $! > pid; wait"});
    options.cwd = dir.path();
    Subprocess child = Subprocess::spawn(options);
    std::string pid_text;
    for (int i = 0; i < 500 && pid_text.find('\n') == std::string::npos; ++i) {
      std::this_thread::sleep_for(milliseconds(10));
      pid_text = read_all(dir / "pid");
    }
    grandchild = std::stoi(pid_text);
    EXPECT_TRUE(alive(grandchild));
  }
  // The grandchild is not ours to reap: once killed it is a zombie until its new parent reaps
  // it, so look at its state rather than at kill(pid, 0).
  bool gone = false;
  for (int i = 0; i < 500 && !gone; ++i) {
    gone = !alive(grandchild);
    if (!gone) std::this_thread::sleep_for(milliseconds(10));
  }
  EXPECT_TRUE(gone);
}

TEST(Subprocess, SignalEndsTheChild) {
  Subprocess child = Subprocess::spawn(command({"sleep", "30"}));
  child.signal(SIGTERM);
  const ExitStatus status = child.wait();
  EXPECT_EQ(status.signal, SIGTERM);
  child.signal(SIGTERM);  // a no-op once reaped
  EXPECT_FALSE(child.running());
}

TEST(Subprocess, MovingTransfersOwnership) {
  Subprocess first = Subprocess::spawn(command({"sh", "-c", "exit 4"}));
  Subprocess second = std::move(first);
  EXPECT_EQ(second.wait().code, 4);
  Subprocess third = Subprocess::spawn(command({"sleep", "30"}));
  const pid_t sleeper = third.pid();
  third = std::move(second);  // kills and reaps the sleeper
  EXPECT_EQ(::kill(sleeper, 0), -1);
  EXPECT_EQ(third.wait().code, 4);
}

TEST(Subprocess, ANonexistentProgramIsIoErrorNamingIt) {
  try {
    Subprocess::spawn(command({"loom-no-such-program-xyz"}));
    FAIL() << "spawn succeeded";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("loom-no-such-program-xyz"), std::string::npos)
        << e.what();
  }
}

TEST(Subprocess, EmptyArgvIsInvalidArgument) {
  EXPECT_THROW(Subprocess::spawn({}), InvalidArgument);
}

// ---- One process per rank ------------------------------------------------------------------

TEST(RankProcesses, EachRankGetsItsOwnOptionsAndItsExitStatus) {
  testing::TempDir dir;
  const auto statuses = run_rank_processes(3, [&](int r) {
    SubprocessOptions o = command({"sh", "-c", "echo rank $RANK; exit $((RANK * 2))"});
    o.env["RANK"] = std::to_string(r);
    o.output = dir / ("rank_" + std::to_string(r) + ".log");
    return o;
  });
  ASSERT_EQ(statuses.size(), 3u);
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(statuses[r].has_value()) << r;
    EXPECT_EQ(statuses[r]->code, 2 * r);
    EXPECT_EQ(statuses[r]->signal, 0);
    EXPECT_EQ(read_all(dir / ("rank_" + std::to_string(r) + ".log")),
              "rank " + std::to_string(r) + "\n");
  }
}

// A rank that fails leaves the others blocked (here in a sleep standing for a collective):
// they are killed after_failure later, long before their own end.
TEST(RankProcesses, AFailedRankEndsTheOthersAfterTheGracePeriod) {
  const auto start = std::chrono::steady_clock::now();
  const auto statuses =
      run_rank_processes(3,
                         [&](int r) {
                           return command({"sh", "-c", r == 1 ? "exit 7" : "exec sleep 60"});
                         },
                         {.after_failure = milliseconds(300)});
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
  ASSERT_TRUE(statuses[1].has_value());
  EXPECT_EQ(statuses[1]->code, 7);
  EXPECT_FALSE(statuses[0].has_value());
  EXPECT_FALSE(statuses[2].has_value());
}

TEST(RankProcesses, RanksStillRunningAtTheTimeoutAreKilled) {
  const auto start = std::chrono::steady_clock::now();
  const auto statuses =
      run_rank_processes(2,
                         [&](int r) {
                           return command({"sh", "-c", r == 0 ? "exit 0" : "exec sleep 60"});
                         },
                         {.timeout = milliseconds(300)});
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
  ASSERT_TRUE(statuses[0].has_value());
  EXPECT_TRUE(statuses[0]->ok());
  EXPECT_FALSE(statuses[1].has_value());
}

}  // namespace
}  // namespace loom::util
