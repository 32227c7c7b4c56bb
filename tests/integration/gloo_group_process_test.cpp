// The Gloo backend with ranks as real processes: every op and dtype per world size in one run
// (each child loads torch once), and a rank killed in the middle of a loop of all-reduces.

#include <gtest/gtest.h>
#include <signal.h>
#include <torch/torch.h>

#include <chrono>
#include <string>

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

INSTANTIATE_TEST_SUITE_P(Gloo, GlooGroupProcesses, ::testing::Values(2, 3, 4));

TEST(GlooGroupProcessFailure, KilledPeerFailsTheOthersWithinTheDeadline) {
  constexpr int kWorld = 3;
  constexpr int kVictim = 1;
  constexpr milliseconds kOpTimeout{5000};
  const std::vector<loom::testing::RankOutcome> outcomes = run_processes(
      kWorld,
      [&](Rank& r) {
        GlooOptions options;
        options.connect_timeout = std::chrono::seconds(30);
        options.flight_dump_dir = r.dir / "flight";
        auto group = new_gloo_group(r.store, r.rank, r.world, options);
        for (int i = 0; i < 100000; ++i) {
          if (r.rank == kVictim && i == 20) ::raise(SIGKILL);
          at::Tensor tensor = at::ones({1000});
          const auto issued = std::chrono::steady_clock::now();
          try {
            group->all_reduce(tensor, {.timeout = kOpTimeout})->wait();
          } catch (const Error& e) {
            const std::string what = e.what();
            EXPECT_TRUE(dynamic_cast<const CommError*>(&e) || dynamic_cast<const Timeout*>(&e))
                << what;
            EXPECT_NE(what.find("all_reduce #"), std::string::npos) << what;
            EXPECT_GE(i, 20) << what;
            // The op that met the death fails within its timeout (plus scheduling slack).
            EXPECT_LT(std::chrono::steady_clock::now() - issued, kOpTimeout + milliseconds(3000))
                << what;
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

}  // namespace
}  // namespace loom::comm
