// DataParallel with ranks as threads: DDP, ZeRO-1 and ZeRO-2 against single-process
// torch::optim training for W = 1..4 (bitwise at W = 1), bad input (mismatched models, a rank
// that skips backward, unused parameters), checkpoint state across world sizes, memory.

#include "loom/parallel/data_parallel.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <iostream>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "harness/harness.h"
#include "loom/ckpt/state.h"
#include "loom/comm/flight_recorder.h"
#include "loom/comm/gloo.h"
#include "loom/error.h"
#include "loom/metrics/allocations.h"
#include "unit/parallel/equivalence.h"

namespace loom::parallel {
namespace {

using loom::testing::expect_all_ok;
using loom::testing::Rank;
using loom::testing::run_threads;
using namespace loom::testing::parallel;  // NOLINT: the shared test model and reference
using std::chrono::milliseconds;

std::unique_ptr<comm::Group> make_group(Rank& r) {
  comm::GlooOptions options;
  options.connect_timeout = std::chrono::seconds(20);
  return comm::new_gloo_group(r.store, r.rank, r.world, options);
}

class DataParallelWorld : public ::testing::TestWithParam<std::tuple<int, ZeroStage>> {
 protected:
  void SetUp() override { torch::set_num_threads(1); }  // process-wide: ranks are threads
};

TEST_P(DataParallelWorld, TrainsLikeSingleProcessTorchOptim) {
  const auto [world, stage] = GetParam();
  expect_all_ok(run_threads(world, [stage = stage](Rank& r) {
    auto group = make_group(r);
    check_equivalence(*group, stage);
  }));
}

INSTANTIATE_TEST_SUITE_P(Threads, DataParallelWorld, loom::testing::parallel::worlds_and_stages(),
                         loom::testing::parallel::world_and_stage_name);

TEST(DataParallel, BucketsFollowReverseRegistrationOrder) {
  expect_all_ok(run_threads(1, [](Rank& r) {
    auto group = make_group(r);
    DataParallel dp(make_model(), *group, {.bucket_bytes = 1});  // one parameter per bucket
    ASSERT_EQ(dp.bucket_count(), 6);
    EXPECT_EQ(dp.bucket_parameters(0), std::vector<std::string>{"fc3.bias"});
    EXPECT_EQ(dp.bucket_parameters(5), std::vector<std::string>{"fc1.weight"});
  }));
}

TEST(DataParallel, MismatchedModelsAreAnErrorNamingRankAndParameter) {
  const auto outcomes = run_threads(2, [](Rank& r) {
    auto group = make_group(r);
    auto model = std::make_shared<Mlp>(r.rank == 0 ? 16 : 12);
    const std::string message = loom::testing::error_of<InvalidArgument>(
        [&] { DataParallel dp(model, *group, {.timeout = std::chrono::seconds(20)}); });
    EXPECT_NE(message.find("rank 1"), std::string::npos) << message;
    EXPECT_NE(message.find("fc1.weight|float32|[16, 8]"), std::string::npos) << message;
    EXPECT_NE(message.find("fc1.weight|float32|[12, 8]"), std::string::npos) << message;
  });
  expect_all_ok(outcomes);
}

// The same checks over a separate control group (Runtime::control_group()): the tensor group
// then carries only the parameter broadcasts.
TEST(DataParallel, ConstructionChecksTravelOverTheControlGroup) {
  const auto outcomes = run_threads(2, [](Rank& r) {
    auto group = make_group(r);
    comm::GlooOptions control_options;
    control_options.name = "control";
    auto control = comm::new_gloo_group(r.store, r.rank, r.world, control_options);
    auto model = std::make_shared<Mlp>(r.rank == 0 ? 16 : 12);
    const std::string message = loom::testing::error_of<InvalidArgument>(
        [&] { DataParallel dp(model, *group, *control, {.timeout = std::chrono::seconds(20)}); });
    EXPECT_NE(message.find("fc1.weight|float32|[12, 8]"), std::string::npos) << message;
    EXPECT_EQ(group->flight_recorder().snapshot().size(), 0u);
    const auto checks = control->flight_recorder().snapshot();
    ASSERT_EQ(checks.size(), 2u);
    EXPECT_EQ(checks[0].op, "all_gather");
    EXPECT_EQ(checks[1].op, "all_gather");

    DataParallel dp(make_model(), *group, *control, {.bucket_bytes = 1});
    EXPECT_EQ(control->flight_recorder().snapshot().size(), 4u);
    EXPECT_EQ(group->flight_recorder().snapshot().size(), 6u);  // one broadcast per bucket
  });
  expect_all_ok(outcomes);
}

// Parameters and buffers must share one device; the meta device stands in for a GPU here.
TEST(DataParallel, ParametersOnTwoDevicesAreAnErrorNamingTheParameter) {
  expect_all_ok(run_threads(1, [](Rank& r) {
    auto group = make_group(r);
    auto model = make_model();
    model->register_parameter("elsewhere", at::zeros({3}, at::TensorOptions().device(at::kMeta)));
    std::string message =
        loom::testing::error_of<InvalidArgument>([&] { DataParallel dp(model, *group); });
    // The module's own parameter comes first in named_parameters(): the others differ from it.
    EXPECT_NE(message.find("parameter 'fc1.weight' is on cpu but parameter 'elsewhere' is on meta"),
              std::string::npos)
        << message;
    auto buffered = make_model();
    buffered->register_buffer("mask", at::zeros({3}, at::TensorOptions().device(at::kMeta)));
    message = loom::testing::error_of<InvalidArgument>([&] { DataParallel dp(buffered, *group); });
    EXPECT_NE(message.find("buffer 'mask' is on meta but parameter 'fc1.weight' is on cpu"),
              std::string::npos)
        << message;
    EXPECT_EQ(group->flight_recorder().snapshot().size(), 0u) << "checked before any collective";
  }));
}

TEST(DataParallel, RankSkippingBackwardTimesOutNamingTheBucket) {
  expect_all_ok(run_threads(2, [](Rank& r) {
    auto group = make_group(r);
    auto model = make_model();
    DataParallel dp(model, *group, {.bucket_bytes = 300, .timeout = milliseconds(500)});
    if (r.rank == 1) {  // skips backward; stays alive until the peer has seen its deadline
      r.store.get("rank0_done", std::chrono::seconds(30));
      return;
    }
    const auto start = std::chrono::steady_clock::now();
    loss_of(*model, at::ones({2, 8}), at::zeros({2, 4}), at::kFloat).backward();
    const std::string message =
        loom::testing::error_of<Timeout>([&] { dp.finish_gradient_sync(); });
    EXPECT_NE(message.find("bucket 0 of"), std::string::npos) << message;
    EXPECT_NE(message.find("fc3.bias"), std::string::npos) << message;
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
    r.store.set("rank0_done", "1");
  }));
}

// With overlap, buckets are reduced while backward still runs: by the time the first layer's
// gradient (the last to be computed) arrives, the later layers' buckets are already issued.
// Without overlap nothing is issued before finish_gradient_sync, and the result is the same.
TEST(DataParallel, OverlapIssuesBucketsBeforeTheLastGradientAndOffIssuesNone) {
  torch::set_num_threads(1);
  expect_all_ok(run_threads(2, [](Rank& r) {
    std::map<bool, std::map<std::string, at::Tensor>> trained;
    for (bool overlap : {true, false}) {
      auto group = make_group(r);
      auto model = make_model();
      DataParallel dp(
          model, *group,
          {.bucket_bytes = 300, .timeout = std::chrono::seconds(20), .overlap = overlap});
      ASSERT_GE(dp.bucket_count(), 3);
      dp.set_optimizer(std::make_unique<optim::Sgd>());
      const size_t before = group->flight_recorder().snapshot().size();
      size_t issued_before_last_gradient = 0;
      auto hook = model->fc1->weight.register_hook([&](const at::Tensor& g) {
        issued_before_last_gradient = group->flight_recorder().snapshot().size() - before;
        return g;
      });
      loss_of(*model, at::full({4, 8}, 0.1 * (r.rank + 1)), at::zeros({4, 4}), at::kFloat)
          .backward();
      dp.finish_gradient_sync();
      dp.step();
      const SyncStats& stats = dp.last_sync_stats();
      EXPECT_EQ(stats.buckets, dp.bucket_count());
      if (overlap) {
        // fc1.weight's bucket is the last one; every bucket before it is already issued.
        EXPECT_EQ(static_cast<int>(issued_before_last_gradient), dp.bucket_count() - 1);
        EXPECT_EQ(stats.buckets_launched_during_backward, dp.bucket_count());
      } else {
        EXPECT_EQ(issued_before_last_gradient, 0u);
        EXPECT_EQ(stats.buckets_launched_during_backward, 0);
      }
      for (const auto& item : model->named_parameters()) {
        trained[overlap][item.key()] = item.value().detach().clone();
      }
      model->fc1->weight.remove_hook(hook);
    }
    for (const auto& [name, value] : trained[true]) {
      EXPECT_TRUE(value.equal(trained[false].at(name))) << name;
    }
  }));
}

TEST(DataParallel, FinishWithoutBackwardIsAnError) {
  expect_all_ok(run_threads(1, [](Rank& r) {
    auto group = make_group(r);
    DataParallel dp(make_model(), *group);
    const std::string message =
        loom::testing::error_of<InvalidArgument>([&] { dp.finish_gradient_sync(); });
    EXPECT_NE(message.find("no gradient arrived"), std::string::npos) << message;
  }));
}

TEST(DataParallel, SumReductionSumsTheRanksGradients) {
  expect_all_ok(run_threads(3, [](Rank& r) {
    auto group = make_group(r);
    const at::Tensor x = at::full({2, 8}, 0.1 * (r.rank + 1));
    const at::Tensor y = at::zeros({2, 4});
    auto plain = make_model();  // this rank's local gradient, summed by hand
    loss_of(*plain, x, y, at::kFloat).backward();
    at::Tensor expected = plain->fc1->weight.grad().clone();
    group->all_reduce(expected)->wait(std::chrono::seconds(20));

    auto model = make_model();
    DataParallel dp(model, *group,
                    {.reduction = GradReduction::kSum, .timeout = std::chrono::seconds(20)});
    loss_of(*model, x, y, at::kFloat).backward();
    dp.finish_gradient_sync();
    // Not bitwise: the ring sums a bucket's elements in another order than a lone tensor's.
    EXPECT_LE(relative_error(model->fc1->weight.grad(), expected), 1e-6);
  }));
}

TEST(DataParallel, SecondSyncedBackwardBeforeFinishIsAnError) {
  expect_all_ok(run_threads(1, [](Rank& r) {
    auto group = make_group(r);
    auto model = make_model();
    DataParallel dp(model, *group);
    loss_of(*model, at::ones({2, 8}), at::zeros({2, 4}), at::kFloat).backward();
    // The hook's InvalidArgument comes back out of backward() (autograd rethrows it).
    const std::string message = loom::testing::error_of<InvalidArgument>([&] {
      loss_of(*model, at::ones({2, 8}), at::zeros({2, 4}), at::kFloat).backward();
    });
    EXPECT_NE(message.find("no_sync"), std::string::npos) << message;
  }));
}

struct PartlyUsed : Mlp {
  at::Tensor forward(const at::Tensor& x) { return fc1(x).narrow(1, 0, 4); }  // fc2, fc3 unused
};

TEST(DataParallel, UnusedParametersAreNamedOrReducedOnRequest) {
  expect_all_ok(run_threads(2, [](Rank& r) {
    auto group = make_group(r);
    for (const auto& [stage, find_unused] : {std::pair{ZeroStage::kNone, false},
                                             {ZeroStage::kNone, true},
                                             {ZeroStage::kTwo, false},
                                             {ZeroStage::kTwo, true}}) {
      auto model = std::make_shared<PartlyUsed>();
      DataParallel dp(model, *group,
                      {.bucket_bytes = 300,
                       .zero_stage = stage,
                       .find_unused_parameters = find_unused,
                       .timeout = std::chrono::seconds(20)});
      dp.set_optimizer(std::make_unique<optim::Sgd>());
      torch::mse_loss(model->forward(at::ones({2, 8})), at::zeros({2, 4})).backward();
      if (!find_unused) {
        const std::string message =
            loom::testing::error_of<InvalidArgument>([&] { dp.finish_gradient_sync(); });
        EXPECT_NE(message.find("fc3.weight"), std::string::npos) << message;
        EXPECT_NE(message.find("find_unused_parameters"), std::string::npos) << message;
        // The used buckets were reduced on both ranks alike: the group stays in step.
        group->barrier({.timeout = std::chrono::seconds(20)})->wait();
      } else {
        const at::Tensor fc3_before = model->fc3->weight.detach().clone();
        dp.finish_gradient_sync();
        dp.step();
        // A zero gradient: plain SGD leaves the parameter as it was.
        EXPECT_TRUE(model->fc3->weight.detach().equal(fc3_before)) << to_string(stage);
        if (stage == ZeroStage::kNone) {
          EXPECT_TRUE(model->fc3->weight.grad().abs().sum().item<double>() == 0);
        }
      }
    }
  }));
}

TEST(DataParallel, NoSyncAccumulatesWithoutCommunication) {
  expect_all_ok(run_threads(2, [](Rank& r) {
    auto group = make_group(r);
    auto model = make_model();
    DataParallel dp(model, *group, {.timeout = std::chrono::seconds(20)});
    {
      auto guard = dp.no_sync();
      EXPECT_FALSE(dp.sync());
      loss_of(*model, at::full({2, 8}, r.rank + 1.0), at::zeros({2, 4}), at::kFloat).backward();
      dp.finish_gradient_sync();  // a no-op without sync
    }
    EXPECT_TRUE(dp.sync());
    // Each rank still holds its own local gradient: nothing was reduced.
    at::Tensor local = model->fc1->weight.grad().clone();
    at::Tensor all = at::empty({2 * local.numel()});
    group->all_gather(all, local.reshape(-1))->wait(std::chrono::seconds(20));
    EXPECT_FALSE(
        all.narrow(0, 0, local.numel()).equal(all.narrow(0, local.numel(), local.numel())));
  }));
}

constexpr metrics::MemoryCategory kGradientBytes = metrics::MemoryCategory::kGradients;

// 48 equal layers: with 8 KiB buckets, one bucket of about 9 KiB per layer.
struct LayerStack : torch::nn::Module {
  LayerStack() {
    for (int i = 0; i < 48; ++i) {
      layers.push_back(register_module("l" + std::to_string(i), torch::nn::Linear(48, 48)));
    }
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& layer : layers) x = torch::tanh(layer(x));
    return x;
  }
  std::vector<torch::nn::Linear> layers;
};

// ZeRO-2 keeps this rank's gradient shard and at most max_staging_buckets full-size buckets
// alive; DDP keeps every bucket. At W = 4: 1/4 of the gradients plus 2 of 48 buckets, about
// 0.29 of DDP's. And the parameters' .grad() are released after the sync.
TEST(DataParallel, ZeroTwoHoldsAQuarterOfTheGradientsAtFourRanks) {
  torch::set_num_threads(1);
  metrics::count_cpu_allocations();
  std::map<ZeroStage, int64_t> peak;       // rank 0's peak gradient bytes in the last step
  std::map<ZeroStage, int64_t> allocated;  // the allocator's peak of gradient bytes, 4 ranks
  std::mutex mutex;
  for (ZeroStage stage : {ZeroStage::kNone, ZeroStage::kTwo}) {
    const int64_t live_before = metrics::cpu_allocations().of(kGradientBytes).live_bytes;
    metrics::reset_cpu_allocation_peaks();
    expect_all_ok(run_threads(4, [&](Rank& r) {
      auto group = make_group(r);
      auto model = std::make_shared<LayerStack>();
      DataParallel dp(
          model, *group,
          {.bucket_bytes = 8 << 10, .zero_stage = stage, .timeout = std::chrono::seconds(60)});
      EXPECT_EQ(dp.bucket_count(), 48);
      dp.set_optimizer(std::make_unique<optim::AdamW>());
      for (int step = 0; step < 2; ++step) {
        dp.zero_grad();
        model->forward(at::full({4, 48}, 0.1 * (r.rank + 1))).square().mean().backward();
        dp.finish_gradient_sync();
        dp.step();
      }
      if (stage == ZeroStage::kTwo) {
        for (const auto& p : model->parameters()) EXPECT_FALSE(p.grad().defined());
      }
      if (r.rank == 0) {
        std::lock_guard<std::mutex> lock(mutex);
        peak[stage] = dp.last_sync_stats().peak_gradient_bytes;
      }
    }));
    allocated[stage] = metrics::cpu_allocations().of(kGradientBytes).peak_bytes - live_before;
  }
  const double share = static_cast<double>(peak[ZeroStage::kTwo]) / peak[ZeroStage::kNone];
  std::cout << "peak gradient bytes per rank at W=4: DDP " << peak[ZeroStage::kNone] << ", ZeRO-2 "
            << peak[ZeroStage::kTwo] << " (" << share << " of DDP's)\n";
  EXPECT_EQ(peak[ZeroStage::kNone], 48 * 2352 * 4);  // 48 buckets of 2352 floats, none padded
  EXPECT_GE(share, 0.25);
  EXPECT_LE(share, 0.25 + 2.0 / 48 + 1e-9);
  // The same from the allocator: every gradient buffer DataParallel allocated, on all 4 ranks
  // (their peaks need not coincide, so the sum's peak is at most the ranks' peaks added).
  const double allocated_share =
      static_cast<double>(allocated[ZeroStage::kTwo]) / allocated[ZeroStage::kNone];
  std::cout << "allocator-measured peak gradient bytes, 4 ranks together: DDP "
            << allocated[ZeroStage::kNone] << ", ZeRO-2 " << allocated[ZeroStage::kTwo] << " ("
            << allocated_share << ")\n";
  EXPECT_EQ(allocated[ZeroStage::kNone], 4 * peak[ZeroStage::kNone]);
  EXPECT_LE(allocated[ZeroStage::kTwo], 4 * (peak[ZeroStage::kTwo] + 2 * 2352 * 4));
  EXPECT_LE(allocated_share, 0.3);
}

// A parameter larger than a bucket (an input embedding: registered first, so its bucket is the
// last, and its gradient arrives at the very end of backward) is staged alone: ZeRO-2 waits for
// the reduce-scatters still in flight first, so the gradient bytes never exceed the shards plus
// max(max_staging_buckets x bucket_bytes, the largest parameter).
struct InputHeavyStack : torch::nn::Module {
  InputHeavyStack() {
    input = register_module("input", torch::nn::Linear(256, 48));  // 12,336 floats
    for (int i = 0; i < 16; ++i) {
      layers.push_back(register_module("l" + std::to_string(i), torch::nn::Linear(48, 48)));
    }
  }
  at::Tensor forward(at::Tensor x) {
    x = torch::tanh(input(x));
    for (auto& layer : layers) x = torch::tanh(layer(x));
    return x;
  }
  torch::nn::Linear input{nullptr};
  std::vector<torch::nn::Linear> layers;
};

TEST(DataParallel, ZeroTwoStagesAParameterLargerThanABucketAlone) {
  torch::set_num_threads(1);
  constexpr int64_t kShardBytes = (16 * 2352 + 12336) / 4 * 4;  // every bucket's 1/4, floats
  constexpr int64_t kLargestBytes = 12336 * 4;
  std::vector<int64_t> peaks(4);
  expect_all_ok(run_threads(4, [&](Rank& r) {
    auto group = make_group(r);
    auto model = std::make_shared<InputHeavyStack>();
    DataParallel dp(model, *group,
                    {.bucket_bytes = 8 << 10,
                     .zero_stage = ZeroStage::kTwo,
                     .timeout = std::chrono::seconds(60)});
    ASSERT_EQ(dp.bucket_count(), 17);
    dp.set_optimizer(std::make_unique<optim::AdamW>());
    for (int step = 0; step < 3; ++step) {
      dp.zero_grad();
      model->forward(at::full({4, 256}, 0.1 * (r.rank + 1))).square().mean().backward();
      dp.finish_gradient_sync();
      dp.step();
      peaks[r.rank] = std::max(peaks[r.rank], dp.last_sync_stats().peak_gradient_bytes);
    }
  }));
  for (int rank = 0; rank < 4; ++rank) {
    EXPECT_EQ(peaks[rank], kShardBytes + kLargestBytes) << "rank " << rank;
  }
}

// A ZeRO-1 AdamW run at W = 1 saves its state; ranks at W = 2 and 3 load the re-sliced state
// and continue; they end where the W = 1 run ends when it simply continues.
class DataParallelState : public ::testing::TestWithParam<std::tuple<int, ZeroStage>> {};

TEST_P(DataParallelState, SavedAtOneWorldSizeLoadsAtAnother) {
  torch::set_num_threads(1);
  const auto [world, stage] = GetParam();
  for (bool bf16 : {false, true}) {
    Scenario first{.name = "first", .stage = stage, .bf16 = bf16, .steps = 2};
    Scenario more = first;
    more.steps = 2;
    std::map<std::string, at::Tensor> saved;  // name -> the global tensor
    std::map<std::string, std::string> blobs;
    std::map<std::string, at::Tensor> continued;
    const at::ScalarType dtype = bf16 ? at::kBFloat16 : at::kFloat;
    expect_all_ok(run_threads(1, [&](Rank& r) {
      auto group = make_group(r);
      auto model = make_model(dtype);
      DataParallel dp(model, *group, {.bucket_bytes = 300, .zero_stage = stage});
      train_data_parallel(dp, *model, 0, 1, first);
      ckpt::State state;
      dp.add_state(state);
      for (const auto& entry : state.tensors) {
        if (entry.sharding.kind == ckpt::Sharding::Kind::kFlat) {
          EXPECT_EQ(entry.sharding.begin, 0);
          EXPECT_EQ(entry.sharding.end, entry.tensor.numel());  // W = 1 owns everything
          saved[entry.name] = entry.tensor.clone().view(entry.sharding.global_shape);
        } else {
          saved[entry.name] = entry.tensor.clone();
        }
      }
      blobs = state.blobs;
      // Continue at W = 1 (same optimizer object and state); global batches of `world` ranks.
      for (int step = 0; step < more.steps; ++step) {
        const auto [x, y] = global_batch(10 + step, world, more);
        dp.zero_grad();
        loss_of(*model, x, y, dtype).backward();
        dp.finish_gradient_sync();
        dp.step();
      }
      for (const auto& item : model->named_parameters()) {
        continued[item.key()] = item.value().detach().clone();
      }
    }));
    ASSERT_TRUE(saved.count("optim/fc1.weight/exp_avg"));
    EXPECT_EQ(saved.count("optim/fc1.weight/master"), bf16 ? 1u : 0u);
    expect_all_ok(run_threads(world, [&, stage = stage, world = world](Rank& r) {
      auto group = make_group(r);
      auto model = make_model(dtype);
      DataParallel dp(model, *group, {.bucket_bytes = 300, .zero_stage = stage});
      dp.set_optimizer(make_flat_optimizer(first));
      ckpt::State state;
      dp.add_state(state);
      for (auto& entry : state.tensors) {  // what a checkpointer does: fill the pieces
        const at::Tensor& global = saved.at(entry.name);
        if (entry.sharding.kind == ckpt::Sharding::Kind::kFlat) {
          entry.tensor.copy_(global.reshape(-1).narrow(0, entry.sharding.begin,
                                                       entry.sharding.end - entry.sharding.begin));
        } else {
          torch::NoGradGuard no_grad;
          entry.tensor.copy_(global);
        }
      }
      state.blobs = blobs;
      dp.load_state(state);
      EXPECT_EQ(dp.step_count(), 2);
      // The restore itself is exact: what the rank holds after load_state (fp32 masters,
      // moments, parameters) is bitwise its slice of the saved state, so a master re-derived
      // from the bf16 parameters (one bf16 rounding off) fails here, below any tolerance.
      ckpt::State reloaded;
      dp.add_state(reloaded);
      ASSERT_EQ(reloaded.tensors.size(), state.tensors.size());
      for (const auto& entry : reloaded.tensors) {
        const at::Tensor& global = saved.at(entry.name);
        const at::Tensor expected =
            entry.sharding.kind == ckpt::Sharding::Kind::kFlat
                ? global.reshape(-1).narrow(0, entry.sharding.begin,
                                            entry.sharding.end - entry.sharding.begin)
                : global;
        EXPECT_EQ(entry.tensor.scalar_type(), expected.scalar_type()) << entry.name;
        EXPECT_TRUE(torch::equal(entry.tensor.reshape(-1), expected.reshape(-1))) << entry.name;
      }
      for (int step = 0; step < more.steps; ++step) {
        const auto [x, y] = global_batch(10 + step, world, more);
        dp.zero_grad();
        loss_of(*model, rows_of(x, r.rank, 0, more), rows_of(y, r.rank, 0, more), dtype).backward();
        dp.finish_gradient_sync();
        dp.step();
      }
      // bf16: the W = 1 run rounds one gradient of the whole batch to bf16, the ranks round
      // their shares' gradients: they differ by bf16 rounding (~4e-3), not by the state.
      expect_parameters_match(*model, continued, bf16 ? 2e-2 : 1e-6,
                              "resumed at W=" + std::to_string(world));
    }));
  }
}

INSTANTIATE_TEST_SUITE_P(Threads, DataParallelState,
                         ::testing::Combine(::testing::Values(2, 3),
                                            ::testing::Values(ZeroStage::kOne, ZeroStage::kTwo)),
                         loom::testing::parallel::world_and_stage_name);

// A corrupt 'optim' blob (not JSON, a field missing, a step that is not an integer) is
// CorruptData naming the blob and quoting it, not nlohmann's exception.
TEST(DataParallel, ACorruptOptimBlobIsCorruptDataQuotingIt) {
  torch::set_num_threads(1);
  expect_all_ok(run_threads(1, [&](Rank& r) {
    auto group = make_group(r);
    auto model = std::make_shared<Mlp>(8);
    DataParallel dp(model, *group, {.zero_stage = ZeroStage::kOne});
    dp.set_optimizer(std::make_unique<optim::AdamW>());
    for (const auto& [blob, cause] : loom::testing::parallel::corrupt_optim_blobs()) {
      SCOPED_TRACE(blob);
      ckpt::State state;
      dp.add_state(state);
      state.blobs["optim"] = blob;
      EXPECT_EQ(loom::testing::error_of<CorruptData>([&] { dp.load_state(state); }),
                "DataParallel::load_state: the 'optim' blob is corrupt (" + cause + "): " + blob);
    }
  }));
}

TEST(DataParallel, OptimizerStateShrinksWithTheWorld) {
  torch::set_num_threads(1);
  std::map<std::pair<int, int>, int64_t> bytes;  // (stage, world) -> rank 0's bytes
  for (ZeroStage stage : {ZeroStage::kNone, ZeroStage::kOne}) {
    for (int world : {1, 2, 4}) {
      std::mutex mutex;
      expect_all_ok(run_threads(world, [&](Rank& r) {
        auto group = make_group(r);
        auto model = std::make_shared<Mlp>(256);  // ~70k parameters
        DataParallel dp(model, *group, {.bucket_bytes = 64 << 10, .zero_stage = stage});
        dp.set_optimizer(std::make_unique<optim::AdamW>());
        if (r.rank == 0) {
          std::lock_guard<std::mutex> lock(mutex);
          bytes[{static_cast<int>(stage), world}] = dp.optimizer_state_bytes();
        }
      }));
      std::cout << "optimizer state bytes per rank, " << to_string(stage) << ", W=" << world << ": "
                << bytes[{static_cast<int>(stage), world}] << "\n";
    }
  }
  const int64_t full = bytes[{0, 1}];
  const int64_t replicated_at_4 = bytes[{0, 4}];
  EXPECT_EQ(replicated_at_4, full);
  for (int world : {2, 4}) {
    const double share = static_cast<double>(bytes[{1, world}]) / full;
    EXPECT_NEAR(share, 1.0 / world, 0.01) << "W=" << world;
  }
}

}  // namespace
}  // namespace loom::parallel

namespace loom::parallel {
namespace {

// A module with a bool buffer (like a causal mask): rank 0's value reaches every rank.
struct MaskedImpl : torch::nn::Module {
  MaskedImpl() : fc(register_module("fc", torch::nn::Linear(4, 4))) {
    mask = register_buffer("mask", torch::zeros({4, 4}, torch::kBool));
  }
  torch::nn::Linear fc;
  torch::Tensor mask;
};

TEST(DataParallelBuffers, BoolBuffersAreBroadcastFromRankZero) {
  testing::expect_all_ok(testing::run_threads(2, [](testing::Rank& r) {
    auto group = comm::new_gloo_group(r.store, r.rank, r.world);
    auto module = std::make_shared<MaskedImpl>();
    if (r.rank == 0) module->mask.fill_(true);
    DataParallel dp(module, *group);
    EXPECT_TRUE(module->mask.all().item<bool>()) << "rank " << r.rank;
  }));
}

}  // namespace
}  // namespace loom::parallel
