// DataParallel (DDP, ZeRO-1, ZeRO-2) on one GPU: NCCL at world size 1 carries the tensors, a
// Gloo group the construction checks, and the result is checked against single-process
// training of the same model on the same GPU with torch::optim. Skipped where libtorch has no
// CUDA or no GPU is visible. The model, data and scenarios are the CPU tests' (equivalence.h).
#include "loom/parallel/data_parallel.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "loom/ckpt/state.h"
#include "loom/comm/flight_recorder.h"
#include "loom/comm/gloo.h"
#include "loom/comm/nccl.h"
#include "loom/comm/store.h"
#include "unit/parallel/equivalence.h"

namespace loom::parallel {
namespace {

using namespace loom::testing::parallel;  // NOLINT: the shared test model and scenarios

const torch::Device kCuda(torch::kCUDA, 0);

// One GPU rank: an NCCL tensor group and a Gloo control group over one in-memory store.
struct GpuRank {
  comm::InMemoryStore store;
  std::unique_ptr<comm::Group> tensors = comm::new_nccl_group(store, 0, 1, {.device = 0});
  std::unique_ptr<comm::Group> control = [this] {
    comm::GlooOptions options;
    options.name = "control";
    return comm::new_gloo_group(store, 0, 1, options);
  }();
};

// Trains scenario `s` with DataParallel on the GPU; returns the parameters on the host.
std::map<std::string, at::Tensor> data_parallel_on_gpu(GpuRank& rank, const Scenario& s,
                                                       SyncStats* stats = nullptr) {
  const at::ScalarType dtype = s.bf16 ? at::kBFloat16 : at::kFloat;
  auto model = make_model(dtype);
  model->to(kCuda);
  DataParallel dp(model, *rank.tensors, *rank.control,
                  {.bucket_bytes = s.bucket_bytes, .zero_stage = s.stage});
  EXPECT_GT(dp.bucket_count(), 1);
  dp.set_optimizer(make_flat_optimizer(s));
  for (int step = 0; step < s.steps; ++step) {
    const auto [x, y] = global_batch(step, 1, s);
    dp.zero_grad();
    for (int m = 0; m < s.micro_steps; ++m) {
      dp.set_sync(m + 1 == s.micro_steps);
      (loss_of(*model, rows_of(x, 0, m, s).to(kCuda), rows_of(y, 0, m, s).to(kCuda), dtype) /
       s.micro_steps)
          .backward();
    }
    dp.finish_gradient_sync();
    if (stats) *stats = dp.last_sync_stats();
    if (s.clip > 0) dp.clip_grad_norm(s.clip);
    dp.step();
  }
  std::map<std::string, at::Tensor> out;
  for (const auto& item : model->named_parameters()) {
    EXPECT_TRUE(item.value().is_cuda()) << item.key();
    out[item.key()] = item.value().detach().cpu();
  }
  return out;
}

class CudaDataParallel : public ::testing::TestWithParam<ZeroStage> {
 protected:
  void SetUp() override {
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device visible to libtorch";
  }
};

// Tolerances: both sides run on the same GPU (with accumulation the reference takes one
// backward over the whole batch, a different summation order), but the update is
// Loom's fused AdamW kernel (or its SGD) against torch::optim's sequence of ATen kernels,
// which round differently where nvcc contracts a multiply and an add into an FMA; cuBLAS may
// also pick another algorithm for parameters that are views into a bucket. Three steps keep
// that at a few ulps of the parameters (fp32: 1e-5 of the largest element leaves 100x room).
// bf16 parameters are rounded from fp32 masters: one ulp of difference in a master can flip
// the rounding, one bf16 ulp is 2^-8 relative (the CPU tests' 2e-2 is the same bound).
TEST_P(CudaDataParallel, TrainsLikeSingleProcessTrainingOnTheGpu) {
  GpuRank rank;
  for (Scenario s : scenarios_for(GetParam())) {
    if (s.torch_optimizer) continue;  // DataParallel's own optimizers only
    const auto expected = reference_training(1, s, kCuda);
    const auto actual = data_parallel_on_gpu(rank, s);
    const auto init = initial_parameters();
    EXPECT_GT(relative_error(actual.at("fc2.weight"), init.at("fc2.weight")), 1e-3) << s.name;
    for (const auto& [name, tensor] : expected) {
      EXPECT_LE(relative_error(actual.at(name), tensor), s.bf16 ? 2e-2 : 1e-5)
          << s.name << ": " << name;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Stages, CudaDataParallel,
                         ::testing::Values(ZeroStage::kNone, ZeroStage::kOne, ZeroStage::kTwo),
                         [](const auto& info) { return std::string(to_string(info.param)); });

// The buckets are reduced on NCCL's stream while backward still runs: finish_gradient_sync
// does not launch them.
TEST(CudaDataParallelOverlap, BucketsAreLaunchedDuringBackward) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device visible to libtorch";
  GpuRank rank;
  SyncStats stats;
  data_parallel_on_gpu(rank, {.name = "overlap", .bucket_bytes = 300}, &stats);
  EXPECT_GT(stats.buckets, 1);
  EXPECT_EQ(stats.buckets_launched_during_backward, stats.buckets);
  // The construction checks went over the control group, tensors over NCCL.
  EXPECT_GT(rank.control->flight_recorder().snapshot().size(), 0u);
  EXPECT_GT(rank.tensors->flight_recorder().snapshot().size(), 0u);
}

// Every tensor of the state a checkpoint saves lives on the GPU, fp32 masters for bf16
// parameters included: nothing of the optimizer falls back to host memory.
TEST(CudaDataParallelState, ParametersMastersAndOptimizerStateAreOnTheDevice) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device visible to libtorch";
  GpuRank rank;
  for (ZeroStage stage : {ZeroStage::kNone, ZeroStage::kTwo}) {
    auto model = make_model(at::kBFloat16);
    model->to(kCuda);
    DataParallel dp(model, *rank.tensors, *rank.control,
                    {.bucket_bytes = 300, .zero_stage = stage});
    dp.set_optimizer(make_flat_optimizer({}));
    const auto [x, y] = global_batch(0, 1, {});
    dp.zero_grad();
    loss_of(*model, x.to(kCuda), y.to(kCuda), at::kBFloat16).backward();
    dp.finish_gradient_sync();
    dp.step();
    ckpt::State state;
    dp.add_state(state);
    int masters = 0;
    for (const auto& entry : state.tensors) {
      EXPECT_TRUE(entry.tensor.is_cuda()) << entry.name;
      if (entry.name.size() > 7 && entry.name.substr(entry.name.size() - 7) == "/master") {
        EXPECT_EQ(entry.tensor.scalar_type(), at::kFloat) << entry.name;
        ++masters;
      }
    }
    EXPECT_EQ(masters, 6) << to_string(stage);  // one per parameter of the Mlp
  }
}

}  // namespace
}  // namespace loom::parallel
