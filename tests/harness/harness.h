// The multi-rank test harness: run N ranks as threads over an InMemoryStore, or as real
// processes (re-executions of the current test binary) over a FileStore, and collect every
// rank's failure. Plus RAII temporary directories.
//
//   TEST(Allreduce, Sums) {
//     loom::testing::expect_all_ok(loom::testing::run_threads(3, [](loom::testing::Rank& r) {
//       ... r.rank, r.world, r.store, r.dir ...
//     }));
//   }
//
// A rank fails when its function throws or records a GoogleTest failure. A failure recorded on
// a rank's thread is captured into that rank's outcome, not into the enclosing test: check the
// outcomes (expect_all_ok). run_processes re-runs the current test in each child with
// LOOM_TEST_RANK/WORLD/DIR set; in a child the call runs the function for that rank and ends the
// process (exit 0 on success), so call it at most once per TEST. A child that exceeds the
// timeout is killed and reported.
#pragma once

#include <chrono>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "loom/comm/store.h"

namespace loom::testing {

// Whether this build runs under a sanitizer (tools/run-tests.sh --sanitize=...): the few tests
// that measure the allocator or wall time skip there, saying why.
#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool kAddressSanitizer = true;
#else
inline constexpr bool kAddressSanitizer = false;
#endif
#if defined(__SANITIZE_THREAD__)
inline constexpr bool kThreadSanitizer = true;
#else
inline constexpr bool kThreadSanitizer = false;
#endif

// A fresh directory under $TMPDIR (or /tmp), removed with its contents on destruction.
class TempDir {
 public:
  explicit TempDir(const std::string& prefix = "loom-test");
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

 private:
  std::filesystem::path path_;
};

// What a rank function sees.
struct Rank {
  int rank;
  int world;
  comm::Store& store;         // shared by all ranks of this run
  std::filesystem::path dir;  // a directory shared by all ranks of this run
};

struct RankOutcome {
  int rank = 0;
  bool ok = false;
  std::string error;  // what failed: the exception, "N GoogleTest failure(s)", the exit status
};

using RankFn = std::function<void(Rank&)>;

std::vector<RankOutcome> run_threads(int world, const RankFn& fn);

struct ProcessOptions {
  std::chrono::seconds timeout{120};       // the whole run; stragglers are SIGKILLed
  std::map<std::string, std::string> env;  // extra environment for every child
};
std::vector<RankOutcome> run_processes(int world, const RankFn& fn, const ProcessOptions& = {});

// True in a child started by run_processes.
bool in_child_process();

// Runs a program to completion, capturing stdout and stderr together into
// <scratch_dir>/program_output.txt, and returns how it ended and what it printed.
struct ProgramResult {
  int exit_code = -1;  // -1 when killed by a signal
  int signal = 0;
  std::string output;
};
ProgramResult run_program(const std::vector<std::string>& argv,
                          const std::filesystem::path& scratch_dir);

#ifdef LOOM_BINARY_DIR
// Runs the built `loom` tool with `args` in `dir` (test binaries know the build directory).
inline ProgramResult run_loom(const TempDir& dir, std::vector<std::string> args) {
  args.insert(args.begin(), LOOM_BINARY_DIR "/tools/loom/loom");
  return run_program(args, dir.path());
}
#endif

// Whether `text` contains `part`; for checking program output and error messages.
inline bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// The message of the exception `fn` throws, which must be of type E; a
// GoogleTest failure when it throws nothing.
template <typename E, typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an exception";
  return "";
}

// Records one GoogleTest failure per failed rank, naming the rank and its error.
void expect_all_ok(const std::vector<RankOutcome>& outcomes);

}  // namespace loom::testing
