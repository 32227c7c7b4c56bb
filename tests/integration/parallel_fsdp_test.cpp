// FullyShardedDataParallel with ranks as real processes over a FileStore: every scenario of the
// threaded unit test (fsdp_equivalence.h: accumulation, clipping, bf16 parameters, the
// mixed-precision policy, fp32 reduction, units kept gathered) trains to the parameters of
// single-process torch::optim training, at W = 1, 2, 3 and 4.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <string>

#include "harness/harness.h"
#include "loom/comm/gloo.h"
#include "unit/parallel/fsdp_equivalence.h"

namespace loom::parallel {
namespace {

using loom::testing::Rank;

class FsdpProcesses : public ::testing::TestWithParam<int> {};

TEST_P(FsdpProcesses, TrainsLikeSingleProcessTorchOptim) {
  loom::testing::expect_all_ok(loom::testing::run_processes(
      GetParam(),
      [](Rank& r) {
        torch::set_num_threads(1);
        comm::GlooOptions options;
        options.connect_timeout = std::chrono::seconds(30);
        auto group = comm::new_gloo_group(r.store, r.rank, r.world, options);
        loom::testing::fsdp::check_equivalence(*group);
      },
      {.timeout = std::chrono::seconds(180)}));
}

INSTANTIATE_TEST_SUITE_P(Processes, FsdpProcesses, ::testing::Values(1, 2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return "W" + std::to_string(info.param);
                         });

}  // namespace
}  // namespace loom::parallel
