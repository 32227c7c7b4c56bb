// End to end: real processes where rank 1 skips one all-reduce; both ranks' groups fail or
// time out and dump their flight recorders; `loom flight diff` names that sequence number.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>

#include "harness/harness.h"
#include "loom/comm/gloo.h"
#include "loom/error.h"

namespace loom {
namespace {

TEST(FlightDiffEndToEnd, NamesTheAllReduceRankOneSkipped) {
  testing::TempDir dir;
  const std::filesystem::path flight = dir / "flight";
  testing::ProcessOptions options;
  options.env["LOOM_TEST_FLIGHT_DIR"] = flight.string();
  auto outcomes = testing::run_processes(
      2,
      [](testing::Rank& r) {
        // The parent's directory: this lambda runs in the child, which has its own TempDir.
        const std::filesystem::path dumps = std::getenv("LOOM_TEST_FLIGHT_DIR");
        auto group = comm::new_gloo_group(r.store, r.rank, r.world, {.flight_dump_dir = dumps});
        // Distinct sizes make each all-reduce recognisable: 10, 11, 12, ... elements.
        for (int i = 0; i < 5; ++i) {
          if (r.rank == 1 && i == 2) continue;  // the bug: rank 1 skips collective #3
          auto t = torch::ones({10 + i});
          try {
            group->all_reduce(t, {.timeout = std::chrono::seconds(3)})->wait();
          } catch (const Error&) {
            return;  // the op timed out in Gloo (Timeout): the group dumped its recorder
          }
        }
      },
      options);
  testing::expect_all_ok(outcomes);

  testing::ProgramResult diff = testing::run_program(
      {LOOM_BINARY_DIR "/tools/loom/loom", "flight", "diff", flight.string()}, dir.path());
  EXPECT_EQ(diff.exit_code, 1) << diff.output;
  EXPECT_NE(diff.output.find("DIVERGED"), std::string::npos) << diff.output;
  EXPECT_NE(diff.output.find("#3"), std::string::npos) << diff.output;
  EXPECT_NE(diff.output.find("float32[12]"), std::string::npos) << diff.output;
}

}  // namespace
}  // namespace loom
