// The multi-rank test harness: ranks as threads (InMemoryStore) or as re-executions of the
// test binary (FileStore), each rank's exceptions and GoogleTest failures collected per rank.
//
// How GoogleTest failures are attributed: each rank runs its function under a
// ScopedFakeTestPartResultReporter in INTERCEPT_ONLY_CURRENT_THREAD mode, which GoogleTest
// keeps per thread. A failure recorded on a rank's thread is therefore captured into that
// rank's own array (never another rank's, and not into the enclosing test), and becomes that
// rank's RankOutcome::error; expect_all_ok reports it to the test. This is also what happens in a
// child process, where the failures reach the parent only through the exit status and log.
// A failure recorded on a thread the rank function starts itself is not captured: it goes to
// the enclosing test directly.

#include "harness/harness.h"

#include <cxxabi.h>
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <deque>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <thread>

#include "loom/error.h"
#include "util/files.h"
#include "util/subprocess.h"

namespace loom::testing {
namespace {

constexpr size_t kLogTailLines = 20;

std::string type_name(const std::type_info& type) {
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> name(
      abi::__cxa_demangle(type.name(), nullptr, nullptr, &status), std::free);
  return status == 0 && name ? name.get() : type.name();
}

std::string describe_failures(const ::testing::TestPartResultArray& results) {
  int count = 0;
  std::string details;
  for (int i = 0; i < results.size(); ++i) {
    const ::testing::TestPartResult& part = results.GetTestPartResult(i);
    if (!part.failed()) continue;
    ++count;
    details += detail::concat("\n  ", part.file_name() ? part.file_name() : "(unknown file)", ":",
                              part.line_number(), ": ", part.summary());
  }
  return count == 0 ? "" : detail::concat(count, " GoogleTest failure(s):", details);
}

// Runs fn for one rank on the calling thread; captures what it throws and every GoogleTest
// failure recorded on this thread meanwhile.
RankOutcome run_rank(const RankFn& fn, Rank& rank) {
  ::testing::TestPartResultArray results;
  std::string thrown;
  {
    ::testing::ScopedFakeTestPartResultReporter capture(
        ::testing::ScopedFakeTestPartResultReporter::INTERCEPT_ONLY_CURRENT_THREAD, &results);
    try {
      fn(rank);
    } catch (const std::exception& e) {
      thrown = detail::concat("threw ", type_name(typeid(e)), ": ", e.what());
    } catch (...) {
      thrown = "threw an exception that is not a std::exception";
    }
  }
  const std::string failures = describe_failures(results);
  RankOutcome outcome;
  outcome.rank = rank.rank;
  outcome.ok = thrown.empty() && failures.empty();
  outcome.error = thrown + (thrown.empty() || failures.empty() ? "" : "; ") + failures;
  return outcome;
}

int env_int(const char* name) {
  const char* value = std::getenv(name);
  LOOM_CHECK(value != nullptr, InvalidArgument, "harness: ", name, " is not set");
  return std::stoi(value);
}

std::string current_test_name() {
  const ::testing::TestInfo* test = ::testing::UnitTest::GetInstance()->current_test_info();
  LOOM_CHECK(test != nullptr, InvalidArgument, "run_processes must be called inside a TEST");
  return detail::concat(test->test_suite_name(), ".", test->name());
}

std::filesystem::path log_path(const std::filesystem::path& dir, int rank) {
  return dir / detail::concat("rank_", rank, ".log");
}

// Written by a child that ran its rank successfully: exit code 0 alone could also mean the
// --gtest_filter matched nothing and the rank never ran.
std::filesystem::path done_path(const std::filesystem::path& dir, int rank) {
  return dir / detail::concat("rank_", rank, ".done");
}

std::string log_tail(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::deque<std::string> lines;
  for (std::string line; std::getline(in, line);) {
    lines.push_back(line);
    if (lines.size() > kLogTailLines) lines.pop_front();
  }
  std::string tail;
  for (const std::string& line : lines) tail += "\n  | " + line;
  return detail::concat("; last lines of ", path.string(), ":", tail);
}

// In a child: runs this process's rank and ends the process; never returns.
[[noreturn]] void run_child(int world, const RankFn& fn) {
  RankOutcome outcome;
  try {
    const int rank = env_int("LOOM_TEST_RANK");
    const int child_world = env_int("LOOM_TEST_WORLD");
    LOOM_CHECK(child_world == world, InvalidArgument, "harness: LOOM_TEST_WORLD is ", child_world,
               " but run_processes was called with world ", world);
    const char* dir_env = std::getenv("LOOM_TEST_DIR");
    LOOM_CHECK(dir_env != nullptr, InvalidArgument, "harness: LOOM_TEST_DIR is not set");
    const std::filesystem::path dir = dir_env;
    outcome.rank = rank;
    comm::FileStore store(dir / "store");
    Rank me{rank, world, store, dir};
    outcome = run_rank(fn, me);
    if (outcome.ok) std::ofstream(done_path(dir, rank)) << "ok\n";
  } catch (const std::exception& e) {
    outcome.ok = false;
    outcome.error = detail::concat("harness set-up failed: ", e.what());
  }
  if (!outcome.ok) {
    std::cerr << "loom harness: rank " << outcome.rank << " failed: " << outcome.error << "\n";
  }
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  ::_exit(outcome.ok ? 0 : 1);
}

}  // namespace

TempDir::TempDir(const std::string& prefix) {
  std::string pattern = (std::filesystem::temp_directory_path() / (prefix + "-XXXXXX")).string();
  LOOM_CHECK_SYS(::mkdtemp(pattern.data()) == nullptr ? -1 : 0, "creating a temporary directory ",
                 pattern);
  path_ = pattern;
}

TempDir::~TempDir() {
  std::error_code ignored;
  std::filesystem::remove_all(path_, ignored);
}

std::vector<RankOutcome> run_threads(int world, const RankFn& fn) {
  LOOM_CHECK(world > 0, InvalidArgument, "run_threads: world must be positive, got ", world);
  TempDir dir("loom-threads");
  comm::InMemoryStore store;
  std::vector<RankOutcome> outcomes(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      Rank rank{r, world, store, dir.path()};
      outcomes[r] = run_rank(fn, rank);
    });
  }
  for (std::thread& thread : threads) thread.join();
  return outcomes;
}

std::vector<RankOutcome> run_processes(int world, const RankFn& fn, const ProcessOptions& options) {
  if (in_child_process()) run_child(world, fn);
  LOOM_CHECK(world > 0, InvalidArgument, "run_processes: world must be positive, got ", world);
  const std::string test = current_test_name();
  TempDir dir("loom-procs");

  const auto spawn = [&](int r) {
    util::SubprocessOptions spawn;
    spawn.argv = {std::filesystem::read_symlink("/proc/self/exe").string(),
                  "--gtest_filter=" + test, "--gtest_also_run_disabled_tests"};
    spawn.env = options.env;
    spawn.env["LOOM_TEST_RANK"] = std::to_string(r);
    spawn.env["LOOM_TEST_WORLD"] = std::to_string(world);
    spawn.env["LOOM_TEST_DIR"] = dir.path().string();
    // The child runs exactly the current test once, whatever sharding or report file the
    // parent was given through the environment.
    spawn.env["GTEST_TOTAL_SHARDS"] = "1";
    spawn.env["GTEST_SHARD_INDEX"] = "0";
    spawn.env["GTEST_OUTPUT"] = "";
    spawn.output = log_path(dir.path(), r);
    return spawn;
  };
  const std::vector<std::optional<util::ExitStatus>> statuses = util::run_rank_processes(
      world, spawn,
      {.timeout = std::chrono::duration_cast<std::chrono::milliseconds>(options.timeout)});

  std::vector<RankOutcome> outcomes(world);
  for (int r = 0; r < world; ++r) {
    RankOutcome& outcome = outcomes[r];
    outcome.rank = r;
    const std::optional<util::ExitStatus>& status = statuses[r];
    if (!status) {
      outcome.error =
          detail::concat("did not finish within ", options.timeout.count(), "s; killed");
    } else if (!status->ok()) {
      outcome.error = status->describe();
    } else if (!std::filesystem::exists(done_path(dir.path(), r))) {
      outcome.error =
          detail::concat("exited with code 0 without running the rank (does --gtest_filter=", test,
                         " select this test?)");
    } else {
      outcome.ok = true;
      continue;
    }
    outcome.error += log_tail(log_path(dir.path(), r));
  }
  return outcomes;
}

bool in_child_process() { return std::getenv("LOOM_TEST_RANK") != nullptr; }

void expect_all_ok(const std::vector<RankOutcome>& outcomes) {
  for (const RankOutcome& outcome : outcomes) {
    if (!outcome.ok) ADD_FAILURE() << "rank " << outcome.rank << ": " << outcome.error;
  }
}

ProgramResult run_program(const std::vector<std::string>& argv,
                          const std::filesystem::path& scratch_dir) {
  std::filesystem::path out = scratch_dir / "program_output.txt";
  std::filesystem::remove(out);
  util::SubprocessOptions options;
  options.argv = argv;
  options.output = out;
  util::ExitStatus status = util::Subprocess::spawn(options).wait();
  return {status.code, status.signal,
          std::filesystem::exists(out) ? util::read_file(out) : std::string()};
}

}  // namespace loom::testing
