// DataParallel with ranks as real processes over a FileStore: DDP, ZeRO-1 and ZeRO-2 train to
// the parameters of single-process torch::optim training (the same scenarios as the threaded
// unit tests: accumulation, clipping, bf16 with fp32 masters), at W = 1, 2, 3 and 4.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <tuple>

#include "harness/harness.h"
#include "loom/comm/gloo.h"
#include "unit/parallel/equivalence.h"

namespace loom::parallel {
namespace {

using loom::testing::Rank;

class DataParallelProcesses : public ::testing::TestWithParam<std::tuple<int, ZeroStage>> {};

TEST_P(DataParallelProcesses, TrainsLikeSingleProcessTorchOptim) {
  const auto [world, stage] = GetParam();
  loom::testing::expect_all_ok(loom::testing::run_processes(
      world,
      [stage = stage](Rank& r) {
        torch::set_num_threads(1);
        comm::GlooOptions options;
        options.connect_timeout = std::chrono::seconds(30);
        auto group = comm::new_gloo_group(r.store, r.rank, r.world, options);
        loom::testing::parallel::check_equivalence(*group, stage);
      },
      {.timeout = std::chrono::seconds(120)}));
}

INSTANTIATE_TEST_SUITE_P(Processes, DataParallelProcesses,
                         loom::testing::parallel::worlds_and_stages(),
                         loom::testing::parallel::world_and_stage_name);

}  // namespace
}  // namespace loom::parallel
