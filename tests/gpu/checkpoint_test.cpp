// The checkpointer with CUDA tensors: pinned staging, device-to-host copies on a side stream,
// loads through pinned buffers. The files are the CPU's, so a checkpoint saved from the GPU
// loads on the CPU and back, bitwise, and a GPU ZeRO state reshards onto CPU ranks. Skipped
// where libtorch has no CUDA or no GPU is visible.
#include "loom/ckpt/checkpointer.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <string>

#include "harness/harness.h"
#include "loom/ckpt/state.h"
#include "loom/comm/gloo.h"
#include "loom/comm/nccl.h"
#include "loom/comm/store.h"
#include "loom/parallel/data_parallel.h"
#include "unit/parallel/equivalence.h"

namespace loom::ckpt {
namespace {

using loom::testing::expect_all_ok;
using loom::testing::run_threads;
using loom::testing::TempDir;

const torch::Device kCuda(torch::kCUDA, 0);

// Tensors of every dtype the trainer saves, one of several hash chunks, and a flat shard.
std::map<std::string, torch::Tensor> globals() {
  torch::manual_seed(7);
  return {{"fp32", torch::randn({257, 33})},
          {"bf16", torch::randn({1000}).to(torch::kBFloat16)},
          {"int64", torch::arange(99, torch::kInt64)},
          {"big", torch::randn({3 << 20})}};  // 12 MiB: three 4 MiB hash chunks
}

State state_of(const std::map<std::string, torch::Tensor>& tensors, torch::Device device,
               bool zeros) {
  State state;
  for (const auto& [name, t] : tensors) {
    torch::Tensor on = t.to(device);
    state.add(name, zeros ? torch::zeros_like(on) : on.clone());
  }
  state.blobs["trainer"] = R"({"step":3})";
  return state;
}

void expect_state_equals(const State& state, const std::map<std::string, torch::Tensor>& want,
                         torch::Device device, const std::string& what) {
  for (const auto& entry : state.tensors) {
    EXPECT_EQ(entry.tensor.device(), device) << what << ": " << entry.name;
    EXPECT_TRUE(torch::equal(entry.tensor.cpu(), want.at(entry.name)))
        << what << ": " << entry.name << " differs (bitwise expected)";
  }
  EXPECT_EQ(state.blobs.at("trainer"), R"({"step":3})") << what;
}

class CudaCheckpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device visible to libtorch";
  }
  TempDir dir_;
  comm::InMemoryStore store_;
};

TEST_F(CudaCheckpoint, SavedFromTheGpuLoadsOnTheCpuAndBackBitwise) {
  const auto want = globals();
  Checkpointer ckpt(store_, {.dir = dir_.path()});
  ckpt.save_sync(1, state_of(want, kCuda, false));

  State on_cpu = state_of(want, torch::kCPU, true);
  EXPECT_EQ(ckpt.load(1, on_cpu), 1);
  expect_state_equals(on_cpu, want, torch::kCPU, "GPU save, CPU load");

  State on_gpu = state_of(want, kCuda, true);
  EXPECT_EQ(ckpt.load(1, on_gpu), 1);
  expect_state_equals(on_gpu, want, kCuda, "GPU save, GPU load");

  ckpt.save_sync(2, state_of(want, torch::kCPU, false));  // and the other way
  State back = state_of(want, kCuda, true);
  EXPECT_EQ(ckpt.load(2, back), 2);
  expect_state_equals(back, want, kCuda, "CPU save, GPU load");
  ckpt.verify(1);
  ckpt.verify(2);
}

// A deferred save copies at before_optimizer_step(), on a side stream: what it saves is the
// tensors' values at that call, not the values written on the compute stream after it.
TEST_F(CudaCheckpoint, ADeferredCopyTakesTheValuesAtBeforeOptimizerStep) {
  const auto want = globals();
  Checkpointer ckpt(store_, {.dir = dir_.path()});
  State live = state_of(want, kCuda, false);
  for (int step = 1; step <= 3; ++step) {  // staging reused across saves
    SaveHandle handle = ckpt.save(step, live, {.defer_copy = true});
    ckpt.before_optimizer_step();
    for (auto& entry : live.tensors) entry.tensor.add_(1);  // the next optimizer step
    handle.wait();
    State loaded = state_of(want, torch::kCPU, true);
    ckpt.load(step, loaded);
    std::map<std::string, torch::Tensor> expected;
    for (const auto& [name, t] : want) expected[name] = t + (step - 1);
    expect_state_equals(loaded, expected, torch::kCPU, "deferred save " + std::to_string(step));
  }
}

// ZeRO-1 state saved from one GPU (NCCL, W = 1) loads onto two CPU ranks (Gloo, W = 2) that
// then hold exactly their halves of every flat optimizer tensor.
TEST_F(CudaCheckpoint, GpuZeroStateReshardsOntoCpuRanks) {
  using namespace loom::testing::parallel;  // NOLINT: the shared test model and data
  std::map<std::string, torch::Tensor> saved;
  {
    auto tensors = comm::new_nccl_group(store_, 0, 1, {.device = 0});
    comm::GlooOptions control_options;
    control_options.name = "control";
    auto control = comm::new_gloo_group(store_, 0, 1, control_options);
    auto model = make_model();
    model->to(kCuda);
    parallel::DataParallel dp(model, *tensors, *control,
                              {.bucket_bytes = 300, .zero_stage = parallel::ZeroStage::kOne});
    dp.set_optimizer(make_flat_optimizer({}));
    for (int step = 0; step < 2; ++step) {
      const auto [x, y] = global_batch(step, 1, {});
      dp.zero_grad();
      loss_of(*model, x.to(kCuda), y.to(kCuda), at::kFloat).backward();
      dp.finish_gradient_sync();
      dp.step();
    }
    State state;
    dp.add_state(state);
    for (const auto& entry : state.tensors) saved[entry.name] = entry.tensor.cpu().reshape(-1);
    Checkpointer(store_, {.dir = dir_.path()}).save_sync(2, state);
  }
  ASSERT_TRUE(saved.count("optim/fc1.weight/exp_avg"));
  expect_all_ok(run_threads(2, [&](loom::testing::Rank& r) {
    auto group = comm::new_gloo_group(r.store, r.rank, r.world);
    auto model = make_model();
    parallel::DataParallel dp(model, *group,
                              {.bucket_bytes = 300, .zero_stage = parallel::ZeroStage::kOne});
    dp.set_optimizer(make_flat_optimizer({}));
    State state;
    dp.add_state(state);
    Checkpointer ckpt(r.store, {.dir = dir_.path(), .rank = r.rank, .world_size = r.world});
    EXPECT_EQ(ckpt.load(2, state), 2);
    dp.load_state(state);
    EXPECT_EQ(dp.step_count(), 2);
    for (const auto& entry : state.tensors) {
      const torch::Tensor& global = saved.at(entry.name);
      if (entry.sharding.kind == Sharding::Kind::kFlat) {
        EXPECT_TRUE(torch::equal(
            entry.tensor.reshape(-1),
            global.narrow(0, entry.sharding.begin, entry.sharding.end - entry.sharding.begin)))
            << entry.name << " on rank " << r.rank;
      } else {
        EXPECT_TRUE(torch::equal(entry.tensor.reshape(-1), global)) << entry.name;
      }
    }
  }));
}

}  // namespace
}  // namespace loom::ckpt
