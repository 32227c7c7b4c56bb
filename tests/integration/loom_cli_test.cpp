// The built `loom` tool as a user runs it: exit codes and printed verdicts of `loom flight diff`
// on agreeing dumps, diverged dumps and bad input, and the help text.
#include <gtest/gtest.h>

#include "harness/harness.h"
#include "loom/comm/flight_recorder.h"
#include "util/files.h"
#include "util/subprocess.h"

namespace loom {
namespace {

using testing::contains;
using testing::run_loom;

// Two ranks that issued six all-reduces; rank 1 then issues nothing more when `diverge`.
std::filesystem::path write_dumps(const testing::TempDir& dir, bool diverge) {
  std::filesystem::path flight = dir / "run" / "flight";
  comm::FlightRecorder recorders[2];
  for (int rank = 0; rank < 2; ++rank) {
    for (int i = 0; i < 6; ++i) {
      uint64_t sequence = recorders[rank].enqueue("all_reduce", "float32", 1024, {});
      recorders[rank].start(sequence);
      recorders[rank].finish(sequence, comm::OpState::kCompleted);
    }
    if (rank == 0 || !diverge) recorders[rank].start(recorders[rank].enqueue("barrier", "", 0, {}));
    recorders[rank].dump(comm::flight_dump_file(flight, rank), rank, "world");
  }
  return flight;
}

TEST(LoomCli, FlightDiffOfAgreeingDumpsExitsZero) {
  testing::TempDir dir;
  std::filesystem::path flight = write_dumps(dir, false);
  testing::ProgramResult run = run_loom(dir, {"flight", "diff", flight.string()});
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_TRUE(contains(
      run.output, "compared 2 flight dumps of group \"world\" (ranks 0, 1) in " + flight.string()))
      << run.output;
  EXPECT_TRUE(contains(run.output, "no divergence: all 2 ranks agree up to collective #7"))
      << run.output;
}

TEST(LoomCli, FlightDiffOfDivergedDumpsExitsOne) {
  testing::TempDir dir;
  std::filesystem::path flight = write_dumps(dir, true);
  testing::ProgramResult run = run_loom(dir, {"flight", "diff", flight.string()});
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_TRUE(contains(run.output,
                       "DIVERGED: rank 1 never issued collective #7 (barrier); "
                       "its last op was #6 (all_reduce float32[1024], completed); rank 0 issued "
                       "it (started)"))
      << run.output;
}

TEST(LoomCli, FlightDiffOfBadInputExitsTwo) {
  testing::TempDir dir;
  testing::ProgramResult missing =
      run_loom(dir, {"flight", "diff", (dir / "no-such-dir").string()});
  EXPECT_EQ(missing.exit_code, 2) << missing.output;
  EXPECT_TRUE(contains(missing.output, "error: ")) << missing.output;
  EXPECT_TRUE(contains(missing.output, "no-such-dir")) << missing.output;

  std::filesystem::path flight = write_dumps(dir, false);
  util::write_file_atomic(flight / "rank_1.json", "{ not json");
  testing::ProgramResult malformed = run_loom(dir, {"flight", "diff", flight.string()});
  EXPECT_EQ(malformed.exit_code, 2) << malformed.output;
  EXPECT_TRUE(contains(malformed.output, "error: malformed flight dump")) << malformed.output;
  EXPECT_TRUE(contains(malformed.output, "rank_1.json")) << malformed.output;

  testing::ProgramResult no_dir = run_loom(dir, {"flight", "diff"});
  EXPECT_EQ(no_dir.exit_code, 2) << no_dir.output;
  EXPECT_TRUE(contains(no_dir.output, "error: ")) << no_dir.output;

  testing::ProgramResult unknown = run_loom(dir, {"fligth"});
  EXPECT_EQ(unknown.exit_code, 2) << unknown.output;
  EXPECT_TRUE(contains(unknown.output, "error: ")) << unknown.output;
}

TEST(LoomCli, HelpExplainsTheCommands) {
  testing::TempDir dir;
  testing::ProgramResult top = run_loom(dir, {"--help"});
  EXPECT_EQ(top.exit_code, 0) << top.output;
  EXPECT_TRUE(contains(top.output, "flight")) << top.output;
  EXPECT_TRUE(contains(top.output, "Exit codes")) << top.output;

  testing::ProgramResult flight = run_loom(dir, {"flight", "--help"});
  EXPECT_EQ(flight.exit_code, 0) << flight.output;
  EXPECT_TRUE(contains(flight.output, "diff")) << flight.output;
  EXPECT_TRUE(contains(flight.output, "rank_<r>.json")) << flight.output;

  testing::ProgramResult diff = run_loom(dir, {"flight", "diff", "--help"});
  EXPECT_EQ(diff.exit_code, 0) << diff.output;
  EXPECT_TRUE(contains(diff.output, "0 the ranks agree, 1 they diverged")) << diff.output;
}

}  // namespace
}  // namespace loom
