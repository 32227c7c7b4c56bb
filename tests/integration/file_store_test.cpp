// FileStore across real processes: add is atomic and a barrier built from add and wait holds.

#include "loom/comm/store.h"

#include <gtest/gtest.h>

#include <thread>

#include "harness/harness.h"

namespace loom::comm {
namespace {

using loom::testing::Rank;
using std::chrono::milliseconds;

TEST(FileStoreProcesses, ConcurrentAddsFromFourProcessesSumExactly) {
  static constexpr int kWorld = 4;
  static constexpr int kAdds = 1000;
  loom::testing::expect_all_ok(loom::testing::run_processes(kWorld, [](Rank& r) {
    for (int i = 0; i < kAdds; ++i) r.store.add("counter", 1);
    // Everyone's adds are in once all have arrived.
    r.store.add("arrived", 1);
    const std::string everyone = std::to_string(kWorld);
    for (;;) {
      const std::string arrived = r.store.get("arrived", milliseconds(10000));
      if (arrived == everyone) break;
      std::this_thread::sleep_for(milliseconds(5));
    }
    EXPECT_EQ(r.store.get("counter", milliseconds(1000)), std::to_string(kWorld * kAdds));
  }));
}

TEST(FileStoreProcesses, ABarrierReleasesNoRankBeforeAllArrive) {
  static constexpr int kWorld = 3;
  static constexpr int kRounds = 5;
  loom::testing::expect_all_ok(loom::testing::run_processes(kWorld, [](Rank& r) {
    for (int round = 0; round < kRounds; ++round) {
      const std::string prefix = "round" + std::to_string(round);
      r.store.set(prefix + "/before/" + std::to_string(r.rank), "here");
      if (r.store.add(prefix + "/count", 1) == r.world) r.store.set(prefix + "/open", "");
      r.store.wait({prefix + "/open"}, milliseconds(10000));
      // Past the barrier, every rank's pre-barrier write is visible.
      for (int peer = 0; peer < r.world; ++peer) {
        EXPECT_TRUE(r.store.check({prefix + "/before/" + std::to_string(peer)}))
            << "round " << round << " peer " << peer;
      }
    }
  }));
}

}  // namespace
}  // namespace loom::comm
