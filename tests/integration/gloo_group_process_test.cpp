// The Gloo backend with ranks as real processes: every op and dtype per world size in one run
// (each child loads torch once), random floats through the shared-memory path, and a rank
// killed in the middle of a loop of all-reduces.

#include <gtest/gtest.h>
#include <signal.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <vector>

#include "comm/shm_collectives.h"
#include "harness/harness.h"
#include "loom/comm/gloo.h"
#include "loom/error.h"
#include "unit/comm/collective_reference.h"

namespace loom::comm {
namespace {

using loom::testing::Rank;
using loom::testing::run_processes;
using std::chrono::milliseconds;
namespace ref = loom::testing::collectives;

class GlooGroupProcesses : public ::testing::TestWithParam<int> {};

TEST_P(GlooGroupProcesses, EveryOpAndDtypeMatchesReference) {
  loom::testing::expect_all_ok(
      run_processes(GetParam(),
                    [](Rank& r) {
                      GlooOptions options;
                      options.connect_timeout = std::chrono::seconds(30);
                      auto group = new_gloo_group(r.store, r.rank, r.world, options);
                      int salt = 0;
                      for (at::ScalarType dtype : ref::kAllDtypes) {
                        for (int64_t n : {0, 7})
                          ref::check_ops(*group, dtype, n, ++salt, milliseconds(20000));
                      }
                      // One subgroup of the even ranks, through the same FileStore.
                      if (r.rank % 2 == 0) {
                        std::vector<int> evens;
                        for (int k = 0; k < r.world; k += 2) evens.push_back(k);
                        auto sub = group->new_subgroup(evens);
                        ref::check_ops(*sub, at::kFloat, 7, ++salt, milliseconds(20000));
                      }
                    },
                    {.timeout = std::chrono::seconds(90)}));
}

// The shared-memory path with ranks as processes: random floats through 4 KiB slots (10007
// elements: dozens of pieces, uneven shards), bitwise against the reduction in rank order.
TEST_P(GlooGroupProcesses, RandomFloatsThroughSharedMemoryEqualTheReductionInRankOrder) {
  loom::testing::expect_all_ok(
      run_processes(GetParam(),
                    [](Rank& r) {
                      GlooOptions options;
                      options.connect_timeout = std::chrono::seconds(30);
                      options.shared_memory_slot_bytes = 4096;
                      auto group = new_gloo_group(r.store, r.rank, r.world, options);
                      ASSERT_EQ(gloo_transport(*group), "shared memory");
                      ref::check_random_floats_in_rank_order(*group, 10007, milliseconds(20000));
                    },
                    {.timeout = std::chrono::seconds(90)}));
}

INSTANTIATE_TEST_SUITE_P(Gloo, GlooGroupProcesses, ::testing::Values(2, 3, 4));

// Over TCP (false) and through shared memory (true). Through shared memory the survivors get a
// CommError naming the dead rank within 10 ms of its death, and no segment is left in /dev/shm.
class GlooGroupProcessFailure : public ::testing::TestWithParam<bool> {};

TEST_P(GlooGroupProcessFailure, KilledPeerFailsTheOthersWithinTheDeadline) {
  const bool shared_memory = GetParam();
  constexpr int kWorld = 3;
  constexpr int kVictim = 1;
  constexpr milliseconds kOpTimeout{5000};
  const std::vector<loom::testing::RankOutcome> outcomes = run_processes(
      kWorld,
      [&](Rank& r) {
        GlooOptions options;
        options.connect_timeout = std::chrono::seconds(30);
        options.flight_dump_dir = r.dir / "flight";
        options.shared_memory = shared_memory;
        auto group = new_gloo_group(r.store, r.rank, r.world, options);
        ASSERT_EQ(gloo_transport(*group), shared_memory ? "shared memory" : "tcp");
        for (int i = 0; i < 100000; ++i) {
          if (r.rank == kVictim && i == 20) ::raise(SIGKILL);
          at::Tensor tensor = at::ones({1000});
          const auto issued = std::chrono::steady_clock::now();
          try {
            group->all_reduce(tensor, {.timeout = kOpTimeout})->wait();
          } catch (const Error& e) {
            const std::string what = e.what();
            if (shared_memory) {
              EXPECT_NE(dynamic_cast<const CommError*>(&e), nullptr) << what;
              EXPECT_NE(what.find("rank 1 (pid "), std::string::npos) << what;
              EXPECT_NE(what.find("died"), std::string::npos) << what;
            } else {
              EXPECT_TRUE(dynamic_cast<const CommError*>(&e) || dynamic_cast<const Timeout*>(&e))
                  << what;
            }
            EXPECT_NE(what.find("all_reduce #"), std::string::npos) << what;
            EXPECT_GE(i, 20) << what;
            // The op that met the death fails within its timeout (plus scheduling slack).
            EXPECT_LT(std::chrono::steady_clock::now() - issued, kOpTimeout + milliseconds(3000))
                << what;
            // Rank 0 created the segment: nothing of it is left in /dev/shm.
            EXPECT_EQ(internal::shared_memory_segments(::getpid()), std::vector<std::string>{});
            // Broken for good: the next op fails at once and says why.
            try {
              group->all_reduce(tensor, {.timeout = kOpTimeout})->wait();
              ADD_FAILURE() << "an op after the failure succeeded";
            } catch (const CommError& again) {
              EXPECT_NE(std::string(again.what()).find("broken"), std::string::npos)
                  << again.what();
            }
            return;
          }
        }
        ADD_FAILURE() << "rank " << r.rank << " never noticed that rank " << kVictim << " died";
      },
      {.timeout = std::chrono::seconds(60)});
  ASSERT_EQ(outcomes.size(), static_cast<size_t>(kWorld));
  for (const loom::testing::RankOutcome& outcome : outcomes) {
    if (outcome.rank == kVictim) {
      EXPECT_FALSE(outcome.ok);
      EXPECT_NE(outcome.error.find("signal"), std::string::npos) << outcome.error;
    } else {
      EXPECT_TRUE(outcome.ok) << "rank " << outcome.rank << ": " << outcome.error;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Transports, GlooGroupProcessFailure, ::testing::Bool());

}  // namespace
}  // namespace loom::comm
