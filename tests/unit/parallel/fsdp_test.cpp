// FullyShardedDataParallel with ranks as threads: training against single-process torch::optim
// for W = 1..4 (fsdp_equivalence.h; bitwise at W = 1), the mixed-precision policy (whole model
// and per unit), prefetch, memory against DataParallel, checkpoints across world sizes, policies
// and into DataParallel, and bad input (overlapping units, mismatched models, non-floating dtypes).

#include "loom/parallel/fsdp.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ATen/CPUGeneratorImpl.h>

#include <chrono>
#include <cmath>
#include <iostream>
#include <mutex>

#include "harness/harness.h"
#include "loom/ckpt/checkpointer.h"
#include "loom/ckpt/state.h"
#include "loom/comm/gloo.h"
#include "loom/error.h"
#include "loom/parallel/data_parallel.h"
#include "unit/parallel/equivalence.h"
#include "unit/parallel/fsdp_equivalence.h"

namespace loom::parallel {
namespace {

using loom::parallel::FsdpMemory;
using loom::testing::expect_all_ok;
using loom::testing::Rank;
using loom::testing::run_threads;
using loom::testing::fsdp::Block;
using loom::testing::fsdp::BlockImpl;
using loom::testing::fsdp::expect_match;
using loom::testing::fsdp::loss_of;
using loom::testing::fsdp::make_model;
using loom::testing::fsdp::Parameters;
using loom::testing::fsdp::reference_training;
using loom::testing::fsdp::Shape;
using loom::testing::fsdp::train;
using loom::testing::fsdp::train_fsdp;
using loom::testing::parallel::adamw_options;
using loom::testing::parallel::global_batch;
using loom::testing::parallel::make_flat_optimizer;
using loom::testing::parallel::rows_of;
using loom::testing::parallel::Scenario;
using loom::testing::parallel::sgd_options;

std::unique_ptr<comm::Group> make_group(Rank& r) {
  comm::GlooOptions options;
  options.connect_timeout = std::chrono::seconds(20);
  return comm::new_gloo_group(r.store, r.rank, r.world, options);
}

class FsdpWorld : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override { torch::set_num_threads(1); }  // process-wide: ranks are threads
};

TEST_P(FsdpWorld, TrainsLikeSingleProcessTorchOptim) {
  expect_all_ok(run_threads(GetParam(), [](Rank& r) {
    auto group = make_group(r);
    loom::testing::fsdp::check_equivalence(*group);
  }));
}

// The policy is the plain recipe: bf16 copies of the fp32 parameters, forward and backward on
// the batch, the bf16 gradient converted to fp32, torch AdamW on the fp32 parameters; bitwise
// at W = 1. (At W > 1 each rank's bf16 gradient of its rows is rounded before the ranks' sum,
// which this recipe does not do; TrainsLikeSingleProcessTorchOptim's adamw-param-bf16 cases
// check W = 2..4 against a reference that rounds as the ranks do, within 1e-6 per element.)
TEST(FsdpMixedPrecision, PolicyIsBf16CopiesOfFp32ParametersBitwiseAtOneRank) {
  torch::set_num_threads(1);
  const Shape shape;
  const Scenario s{.name = "adamw-param-bf16"};
  const Parameters expected = reference_training(1, s, shape, {.mixed = true, .per_rank = false});
  Parameters actual;
  expect_all_ok(run_threads(1, [&](Rank& r) {
    auto group = make_group(r);
    actual = train_fsdp(*group, s, shape,
                        {.param_dtype = at::kBFloat16, .timeout = std::chrono::seconds(60)});
  }));
  for (const auto& [name, tensor] : actual) EXPECT_EQ(tensor.scalar_type(), at::kFloat) << name;
  expect_match(actual, expected, 0.0, "param_dtype = bf16 at W=1");
}

INSTANTIATE_TEST_SUITE_P(Threads, FsdpWorld, ::testing::Values(1, 2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return "W" + std::to_string(info.param);
                         });

// DataParallel on the unwrapped model, for comparison.
Parameters train_data_parallel(comm::Group& group, const Scenario& s, const Shape& shape,
                               ZeroStage stage) {
  auto model = make_model(shape, at::kFloat, /*wrap=*/false);
  DataParallel dp(model, group, {.zero_stage = stage});
  dp.set_optimizer(make_flat_optimizer(s));
  for (int step = 0; step < s.steps; ++step) {
    const auto [x, y] = global_batch(step, group.size(), s);
    dp.zero_grad();
    loss_of(*model, rows_of(x, group.rank(), 0, s), rows_of(y, group.rank(), 0, s), at::kFloat)
        .backward();
    dp.finish_gradient_sync();
    dp.step();
  }
  Parameters out;
  for (const auto& item : model->named_parameters())
    out[item.key()] = item.value().detach().clone();
  return out;
}

// Units of 400 x 400 + 400 elements: each shard holds 160K (W = 1) or 80K (W = 2) elements,
// more than one 64K-element optimizer chunk. At W = 2 AdamW is compared with DataParallel
// ZeRO-2, which sums in the same order (bitwise), and SGD with torch (1e-6): against the
// one-backward reference AdamW turns the summation-order rounding of near-zero gradient
// elements of these large matrices into ~1e-5 (its update does not scale with the gradient).
TEST(Fsdp, ShardsLargerThanOneOptimizerChunkTrainLikeTorch) {
  torch::set_num_threads(1);
  const Shape shape{.blocks = 2, .hidden = 400};
  const Scenario adamw{.name = "large-adamw", .steps = 2};
  const Scenario sgd{.name = "large-sgd", .adamw = false, .steps = 2};
  for (const Scenario& s : {adamw, sgd}) {
    const Parameters expected = reference_training(1, s, shape);
    expect_all_ok(run_threads(1, [&](Rank& r) {
      auto group = make_group(r);
      expect_match(train_fsdp(*group, s, shape, {}), expected, 0.0, s.name + " at W=1");
    }));
  }
  const Parameters expected = reference_training(2, sgd, shape);
  expect_all_ok(run_threads(2, [&](Rank& r) {
    auto group = make_group(r);
    expect_match(train_fsdp(*group, sgd, shape, {}), expected, 1e-6, "large-sgd at W=2");
    const Parameters zero2 = train_data_parallel(*group, adamw, shape, ZeroStage::kTwo);
    expect_match(train_fsdp(*group, adamw, shape, {}), zero2, 0.0,
                 "large-adamw at W=2 against DataParallel ZeRO-2");
  }));
}

TEST(Fsdp, PrefetchesTheNextUnitsGatherInForwardAndBackward) {
  torch::set_num_threads(1);
  expect_all_ok(run_threads(2, [](Rank& r) {
    auto group = make_group(r);
    for (bool prefetch : {true, false}) {
      const Shape shape{.blocks = 4};
      auto model = make_model(shape, at::kFloat, true);
      FullyShardedDataParallel fsdp(model, *group, {.prefetch = prefetch});
      const int64_t resting = fsdp.memory().parameter_bytes;  // shards and the gathered root
      const auto [x, y] = global_batch(0, 2, Scenario{});
      const at::Tensor loss = loss_of(*model, x, y, at::kFloat);
      // Freed after forward although autograd saved views of the parameters (addmm keeps
      // weight.t()): the full buffers' storages themselves were released.
      EXPECT_EQ(fsdp.memory().parameter_bytes, resting);
      loss.backward();
      EXPECT_EQ(fsdp.memory().parameter_bytes, resting);
      fsdp.finish_gradient_sync();
      const FsdpStats& stats = fsdp.stats();
      // Units 1..3 are gathered while the previous unit's forward runs; in backward units 2..0
      // while the next one's backward runs.
      EXPECT_EQ(stats.forward_prefetched, prefetch ? 3 : 0);
      EXPECT_EQ(stats.backward_prefetched, prefetch ? 3 : 0);
      EXPECT_EQ(stats.all_gathers, 8);      // each block once for forward, once for backward
      EXPECT_EQ(stats.reduce_scatters, 5);  // the blocks and the root
      EXPECT_GE(stats.reduce_scatters_in_backward, 4);
    }
  }));
}

TEST(Fsdp, KeepingParametersAfterForwardSkipsTheBackwardGather) {
  torch::set_num_threads(1);
  expect_all_ok(run_threads(2, [](Rank& r) {
    auto group = make_group(r);
    auto model = make_model(Shape{}, at::kFloat, true);
    FullyShardedDataParallel fsdp(model, *group, {.reshard_after_forward = false});
    const auto [x, y] = global_batch(0, 2, Scenario{});
    loss_of(*model, x, y, at::kFloat).backward();
    fsdp.finish_gradient_sync();
    EXPECT_EQ(fsdp.stats().all_gathers, 3);
  }));
}

// Bytes of parameters, gradients and AdamW state per rank at W = 4 (peak over two training
// steps) against DataParallel kNone (full parameters, gradients and state on every rank).
TEST(Fsdp, HoldsUnderThirtyPercentOfDataParallelsBytesAtFourRanks) {
  torch::set_num_threads(1);
  const Shape shape{.blocks = 32, .hidden = 48};
  std::mutex mutex;
  int64_t fsdp_peak = 0, fsdp_steady = 0, ddp_bytes = 0;
  expect_all_ok(run_threads(4, [&](Rank& r) {
    auto group = make_group(r);
    {
      auto model = make_model(shape, at::kFloat, true);
      FullyShardedDataParallel fsdp(model, *group);
      fsdp.set_optimizer(std::make_unique<optim::AdamW>(adamw_options()));
      fsdp.reset_peak_memory();  // construction holds the whole model once, to shard it
      train(fsdp, *model, r.rank, 4, Scenario{.steps = 2});
      std::lock_guard<std::mutex> lock(mutex);
      if (r.rank == 0) {
        fsdp_peak = fsdp.peak_memory().total();
        fsdp_steady = fsdp.memory().total();
        const FsdpMemory p = fsdp.peak_memory();
        std::cout << "FSDP W=4 rank 0 peak: parameters " << p.parameter_bytes << ", gradients "
                  << p.gradient_bytes << ", optimizer " << p.optimizer_bytes << " bytes\n";
      }
    }
    auto plain = make_model(shape, at::kFloat, false);
    DataParallel dp(plain, *group, {.zero_stage = ZeroStage::kNone});
    dp.set_optimizer(std::make_unique<optim::AdamW>(adamw_options()));
    int64_t numel = 0;
    for (const at::Tensor& p : plain->parameters()) numel += p.numel();
    std::lock_guard<std::mutex> lock(mutex);
    if (r.rank == 0) ddp_bytes = 2 * numel * 4 + dp.optimizer_state_bytes();  // params + grads
  }));
  const double ratio = static_cast<double>(fsdp_peak) / static_cast<double>(ddp_bytes);
  std::cout << "bytes per rank at W=4: DataParallel kNone " << ddp_bytes << ", FSDP peak "
            << fsdp_peak << " (" << ratio << "x), FSDP between steps " << fsdp_steady << " ("
            << static_cast<double>(fsdp_steady) / static_cast<double>(ddp_bytes) << "x)\n";
  EXPECT_LE(ratio, 0.3);
  EXPECT_GT(ratio, 0.2);  // 1/4 is the floor: not vacuous
}

// A root unit used first and last (an input projection and a head, as a tied embedding is): its
// unsharded gradient buffer exists only once its last gradient has arrived, at the end of
// backward, not from the head's gradient at the start, so it never coexists with the blocks'
// unsharded gradients. With a root four blocks large, holding it from the start would put the
// peak at or above shards + root + two blocks.
struct RootHeavyMlp : torch::nn::Module {
  RootHeavyMlp() {
    inp = register_module("inp", torch::nn::Linear(64, 32));
    blocks = register_module("blocks", torch::nn::Sequential());
    for (int b = 0; b < 8; ++b) blocks->push_back(Block(32, 32));
    head = register_module("head", torch::nn::Linear(32, 64));
  }
  at::Tensor forward(const at::Tensor& x) { return head(blocks->forward(inp(x))); }
  torch::nn::Linear inp{nullptr}, head{nullptr};
  torch::nn::Sequential blocks{nullptr};
};

TEST(Fsdp, TheRootsGradientBufferIsAllocatedOnlyWhenItsLastGradientArrives) {
  torch::set_num_threads(1);
  constexpr int64_t kUnitBytes = (32 * 32 + 32) * 4;                 // one block, unsharded
  constexpr int64_t kRootBytes = (64 * 32 + 32 + 32 * 64 + 64) * 4;  // inp + head
  std::mutex mutex;
  std::vector<std::pair<int64_t, int64_t>> shards_and_peak(4);
  expect_all_ok(run_threads(4, [&](Rank& r) {
    auto group = make_group(r);
    torch::manual_seed(7);
    auto model = std::make_shared<RootHeavyMlp>();
    ASSERT_EQ(wrap_modules<BlockImpl>(model->blocks), 8);
    FullyShardedDataParallel fsdp(model, *group);
    fsdp.set_optimizer(std::make_unique<optim::AdamW>(adamw_options()));
    const int64_t shards = fsdp.memory().gradient_bytes;  // between steps: the shards only
    fsdp.reset_peak_memory();
    const at::Tensor x = at::randn({16, 64}), y = at::randn({16, 64});
    fsdp.zero_grad();
    (model->forward(x) - y).square().mean().backward();
    fsdp.finish_gradient_sync();
    fsdp.step();
    std::lock_guard<std::mutex> lock(mutex);
    shards_and_peak[r.rank] = {shards, fsdp.peak_memory().gradient_bytes};
  }));
  for (int rank = 0; rank < 4; ++rank) {
    const auto [shards, peak] = shards_and_peak[rank];
    SCOPED_TRACE("rank " + std::to_string(rank));
    EXPECT_LT(peak, shards + kRootBytes + 2 * kUnitBytes);
    // Not vacuous: the root's buffer and the last block's gradient being reduced do coexist.
    EXPECT_GE(peak, shards + kRootBytes + kUnitBytes);
  }
}

// The ModuleList policy, and a unit around a wrapper module (as an ActivationCheckpoint around a
// block would be): names stay those of the unwrapped model, an FsdpUnit without FSDP is its
// module, and training through the list matches the same model trained unwrapped with FSDP
// units on nothing (the root only).
struct WrapperImpl : torch::nn::Module {  // stands in for ActivationCheckpoint(block)
  explicit WrapperImpl(Block block) : inner(register_module("inner", std::move(block))) {}
  at::Tensor forward(const at::Tensor& x) { return inner(x) + x; }
  Block inner;
};
TORCH_MODULE(Wrapper);

struct ListModel : torch::nn::Module {
  ListModel() {
    list = register_module("list", torch::nn::ModuleList());
    for (int b = 0; b < 3; ++b) list->push_back(Wrapper(Block(8, 8)));
  }
  at::Tensor forward(at::Tensor x) {
    for (const auto& m : *list) {
      auto* unit = m->as<FsdpUnitImpl>();
      x = unit != nullptr ? unit->forward(x) : m->as<WrapperImpl>()->forward(x);
    }
    return x.narrow(1, 0, 4);
  }
  torch::nn::ModuleList list{nullptr};
};

std::shared_ptr<ListModel> make_list_model(bool wrap) {
  auto model = std::make_shared<ListModel>();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(99);
  torch::NoGradGuard no_grad;
  for (auto& item : model->named_parameters())
    item.value().copy_(at::randn(item.value().sizes(), gen) * 0.3);
  if (wrap) {
    EXPECT_EQ(wrap_modules<WrapperImpl>(model->list), 3);
  }
  return model;
}

TEST(Fsdp, ModuleListPolicyWrapsWrapperModulesAndKeepsNames) {
  torch::set_num_threads(1);
  auto plain = make_list_model(false);
  auto wrapped = make_list_model(true);
  std::vector<std::string> plain_names, wrapped_names;
  for (const auto& item : plain->named_parameters()) plain_names.push_back(item.key());
  for (const auto& item : wrapped->named_parameters()) wrapped_names.push_back(item.key());
  EXPECT_EQ(wrapped_names, plain_names);
  EXPECT_EQ(plain_names.front(), "list.0.inner.fc.weight");
  const at::Tensor x = at::randn({5, 8});
  EXPECT_TRUE(wrapped->forward(x).equal(plain->forward(x))) << "unattached units are their modules";
  wrapped->eval();
  EXPECT_FALSE(wrapped->list[0]->as<FsdpUnitImpl>()->wrapped()->is_training());
  wrapped->train();
  const Scenario s{.name = "list", .steps = 2};
  expect_all_ok(run_threads(2, [&](Rank& r) {
    auto group = make_group(r);
    Parameters results[2];
    for (bool wrap : {false, true}) {
      auto model = make_list_model(wrap);
      FullyShardedDataParallel fsdp(model, *group);
      EXPECT_EQ(fsdp.unit_count(), wrap ? 3 : 1);
      if (wrap) {
        EXPECT_EQ(fsdp.unit_name(2), "list.2");
      }
      fsdp.set_optimizer(make_flat_optimizer(s));
      for (int step = 0; step < s.steps; ++step) {
        const auto [x, y] = global_batch(step, 2, s);
        fsdp.zero_grad();
        (model->forward(rows_of(x, r.rank, 0, s)) - rows_of(y, r.rank, 0, s))
            .square()
            .mean()
            .backward();
        fsdp.finish_gradient_sync();
        fsdp.step();
      }
      results[wrap] = fsdp.gather_full_parameters();
    }
    // The same arithmetic: only the sharding of the flat buffers differs.
    expect_match(results[1], results[0], 0.0, "ModuleList units against the root alone");
  }));
}

// --- mixed precision per unit ------------------------------------------------------------------

// Records the dtypes of its weight and its input in every forward: the unit's compute dtype.
struct ProbeImpl : torch::nn::Module {
  ProbeImpl() : fc(register_module("fc", torch::nn::Linear(8, 8))) {}
  at::Tensor forward(const at::Tensor& x) {
    weight_dtypes.push_back(fc->weight.scalar_type());
    input_dtypes.push_back(x.scalar_type());
    return torch::tanh(fc(x));
  }
  torch::nn::Linear fc;
  std::vector<at::ScalarType> weight_dtypes, input_dtypes;
};
TORCH_MODULE(Probe);

TEST(FsdpMixedPrecision, AUnitWithItsOwnPolicyComputesInItsOwnDtype) {
  torch::set_num_threads(1);
  expect_all_ok(run_threads(2, [](Rank& r) {
    auto group = make_group(r);
    std::vector<Probe> probes{Probe(), Probe(), Probe()};
    torch::nn::Sequential model;
    model->push_back(FsdpUnit(probes[0]));
    model->push_back(FsdpUnit(probes[1], FsdpUnitOptions{.param_dtype = at::kFloat}));
    model->push_back(FsdpUnit(probes[2]));
    model->push_back(torch::nn::Linear(8, 4));  // the root unit
    FullyShardedDataParallel fsdp(model.ptr(), *group, {.param_dtype = at::kBFloat16});
    fsdp.set_optimizer(std::make_unique<optim::AdamW>(adamw_options()));
    const Parameters before = fsdp.gather_full_parameters();
    for (int step = 0; step < 2; ++step) {
      fsdp.zero_grad();
      const at::Tensor out = model->forward(at::randn({4, 8}));  // fp32 input
      EXPECT_EQ(out.scalar_type(), at::kBFloat16) << "the root computes in param_dtype";
      out.to(at::kFloat).square().mean().backward();
      fsdp.finish_gradient_sync();
      fsdp.step();
    }
    const std::vector<at::ScalarType> bf16(2, at::kBFloat16), fp32(2, at::kFloat);
    EXPECT_EQ(probes[0]->weight_dtypes, bf16);
    EXPECT_EQ(probes[0]->input_dtypes, bf16) << "the unit casts its fp32 input";
    EXPECT_EQ(probes[1]->weight_dtypes, fp32) << "the unit's own param_dtype wins";
    EXPECT_EQ(probes[1]->input_dtypes, fp32) << "the bf16 output of unit 0 is cast back";
    EXPECT_EQ(probes[2]->weight_dtypes, bf16);
    EXPECT_EQ(probes[2]->input_dtypes, bf16);
    EXPECT_EQ(model[3]->as<torch::nn::LinearImpl>()->weight.scalar_type(), at::kBFloat16);
    for (const auto& [name, tensor] : fsdp.gather_full_parameters()) {
      EXPECT_EQ(tensor.scalar_type(), at::kFloat) << name << ": the shards stay fp32";
      EXPECT_FALSE(tensor.equal(before.at(name))) << name << " was trained";
    }
  }));
}

// --- checkpoints ------------------------------------------------------------------------------

// The global tensors a set of ranks' States describe, as a checkpointer reassembles them.
void assemble(std::mutex& mutex, std::map<std::string, at::Tensor>& global,
              const ckpt::State& state) {
  std::lock_guard<std::mutex> lock(mutex);
  torch::NoGradGuard no_grad;
  for (const ckpt::TensorEntry& entry : state.tensors) {
    if (entry.sharding.kind == ckpt::Sharding::Kind::kFlat) {
      auto [it, fresh] = global.emplace(
          entry.name, at::zeros(entry.sharding.global_shape, entry.tensor.options()));
      it->second.view(-1)
          .narrow(0, entry.sharding.begin, entry.sharding.end - entry.sharding.begin)
          .copy_(entry.tensor);
    } else {
      global[entry.name] = entry.tensor.detach().clone();
    }
  }
}

TEST(FsdpState, SavedAtFourLoadsAtThreeAsFsdpAndAtTwoAsDataParallel) {
  torch::set_num_threads(1);
  loom::testing::TempDir dir("loom-fsdp-ckpt");
  const Shape shape;
  // The third saves an fp32 model trained under param_dtype = bf16 and loads it without policy.
  for (int variant : {0, 1, 2}) {
    const bool bf16 = variant == 1;
    const FsdpOptions save_options =
        variant == 2 ? FsdpOptions{.param_dtype = at::kBFloat16} : FsdpOptions{};
    const at::ScalarType dtype = bf16 ? at::kBFloat16 : at::kFloat;
    const Scenario s{.name = "ckpt", .bf16 = bf16, .steps = 2};
    const int64_t step = variant + 1;
    auto options = [&](int rank, int world) {
      ckpt::CheckpointerOptions o;
      o.dir = dir.path();
      o.rank = rank;
      o.world_size = world;
      o.direct_io = false;
      return o;
    };
    std::mutex mutex;
    std::map<std::string, at::Tensor> saved, as_fsdp, as_ddp;
    expect_all_ok(run_threads(4, [&](Rank& r) {
      auto group = make_group(r);
      auto model = make_model(shape, dtype, true);
      FullyShardedDataParallel fsdp(model, *group, save_options);
      fsdp.set_optimizer(make_flat_optimizer(s));
      train(fsdp, *model, r.rank, 4, s);
      ckpt::State state;
      fsdp.add_state(state);
      ckpt::Checkpointer(r.store, options(r.rank, 4)).save_sync(step, state);
      assemble(mutex, saved, state);
    }));
    ASSERT_TRUE(saved.count("optim/blocks.0.fc.weight/exp_avg_sq"));
    EXPECT_EQ(saved.count("optim/head.bias/master"), bf16 ? 1u : 0u);
    expect_all_ok(run_threads(3, [&](Rank& r) {
      auto group = make_group(r);
      auto model = make_model(shape, dtype, true);
      FullyShardedDataParallel fsdp(model, *group);
      fsdp.set_optimizer(make_flat_optimizer(s));
      ckpt::State state;
      fsdp.add_state(state);
      ckpt::Checkpointer(r.store, options(r.rank, 3)).load(step, state);
      fsdp.load_state(state);
      EXPECT_EQ(fsdp.step_count(), 2);
      ckpt::State now;
      fsdp.add_state(now);  // what is live after loading
      assemble(mutex, as_fsdp, now);
      // Training continues from the loaded state.
      const auto [x, y] = global_batch(7, 3, s);
      fsdp.zero_grad();
      loss_of(*model, rows_of(x, r.rank, 0, s), rows_of(y, r.rank, 0, s), dtype).backward();
      fsdp.finish_gradient_sync();
      fsdp.step();
    }));
    expect_all_ok(run_threads(2, [&](Rank& r) {
      auto group = make_group(r);
      auto model = make_model(shape, dtype, /*wrap=*/false);  // DataParallel's names are the same
      DataParallel dp(model, *group, {.bucket_bytes = 300, .zero_stage = ZeroStage::kNone});
      dp.set_optimizer(make_flat_optimizer(s));
      ckpt::State state;
      dp.add_state(state);
      ckpt::Checkpointer(r.store, options(r.rank, 2)).load(step, state);
      dp.load_state(state);
      EXPECT_EQ(dp.step_count(), 2);
      ckpt::State now;
      dp.add_state(now);
      assemble(mutex, as_ddp, now);
    }));
    ASSERT_EQ(as_fsdp.size(), saved.size());
    ASSERT_EQ(as_ddp.size(), saved.size());
    for (const auto& [name, tensor] : saved) {
      EXPECT_TRUE(as_fsdp.at(name).equal(tensor)) << "FSDP W=3 " << name << " variant " << variant;
      EXPECT_TRUE(as_ddp.at(name).equal(tensor))
          << "DataParallel W=2 " << name << " variant " << variant;
    }
  }
}

// The names, ranges and dtypes of a State's tensors.
std::vector<std::string> layout_of(const ckpt::State& state) {
  std::vector<std::string> out;
  for (const ckpt::TensorEntry& e : state.tensors) {
    out.push_back(loom::detail::concat(e.name, " [", e.sharding.begin, ", ", e.sharding.end, ") ",
                                       c10::toString(e.tensor.scalar_type())));
  }
  return out;
}

void expect_same_tensors(const ckpt::State& actual, const ckpt::State& expected,
                         const std::string& what) {
  ASSERT_EQ(layout_of(actual), layout_of(expected)) << what;
  for (size_t i = 0; i < expected.tensors.size(); ++i) {
    EXPECT_TRUE(actual.tensors[i].tensor.equal(expected.tensors[i].tensor))
        << what << ": " << expected.tensors[i].name;
  }
}

// fp32 FSDP -> param_dtype = bf16 FSDP -> fp32 FSDP at W = 2 through in-memory States: the
// policy's state is the fp32 shards under the same names and ranges (no "master" entries).
TEST(FsdpState, AMixedPrecisionRunAndAnFp32RunLoadEachOthersState) {
  torch::set_num_threads(1);
  const Shape shape;
  const Scenario s{.name = "mp-state", .steps = 2};
  expect_all_ok(run_threads(2, [&](Rank& r) {
    auto group = make_group(r);
    const FsdpOptions policy{.param_dtype = at::kBFloat16};
    auto plain_model = make_model(shape, at::kFloat, true);
    FullyShardedDataParallel plain(plain_model, *group);
    plain.set_optimizer(make_flat_optimizer(s));
    train(plain, *plain_model, r.rank, 2, s);
    ckpt::State saved;
    plain.add_state(saved);

    auto mixed_model = make_model(shape, at::kFloat, true);
    FullyShardedDataParallel mixed(mixed_model, *group, policy);
    mixed.set_optimizer(make_flat_optimizer(s));
    ckpt::State fresh;
    mixed.add_state(fresh);
    EXPECT_EQ(layout_of(fresh), layout_of(saved)) << "the same names, ranges and dtypes";
    for (const std::string& entry : layout_of(fresh)) {
      EXPECT_EQ(entry.find("/master"), std::string::npos) << entry;
    }
    mixed.load_state(saved);
    EXPECT_EQ(mixed.step_count(), 2);
    ckpt::State loaded;
    mixed.add_state(loaded);
    expect_same_tensors(loaded, saved, "fp32 FSDP into the bf16 policy");
    train(mixed, *mixed_model, r.rank, 2, Scenario{.name = "more", .steps = 1});
    ckpt::State mixed_saved;
    mixed.add_state(mixed_saved);

    auto again_model = make_model(shape, at::kFloat, true);
    FullyShardedDataParallel again(again_model, *group);
    again.set_optimizer(make_flat_optimizer(s));
    again.load_state(mixed_saved);
    EXPECT_EQ(again.step_count(), 3);
    ckpt::State again_state;
    again.add_state(again_state);
    expect_same_tensors(again_state, mixed_saved, "the bf16 policy into fp32 FSDP");
    const Parameters a = again.gather_full_parameters(), b = mixed.gather_full_parameters();
    for (const auto& [name, tensor] : b) {
      EXPECT_TRUE(a.at(name).equal(tensor)) << name;
    }
  }));
}

// --- optimizer offload ------------------------------------------------------------------------

// offload_optimizer_state at W = 2: the state and fp32 masters are host tensors apart from the
// parameters' (on this CPU-only machine the "device" is the host too, so the test checks the
// path's arithmetic and bookkeeping: gradients handed to a separate master, updated there and
// copied back). fp32 and bf16 models, AdamW with accumulation and clipping: every parameter and
// every checkpoint tensor bitwise equal to the same run without offload, the same names and
// ranges, and each run's state loads into the other.
ckpt::State deep_copy(const ckpt::State& state) {
  ckpt::State copy = state;
  for (ckpt::TensorEntry& entry : copy.tensors) entry.tensor = entry.tensor.clone();
  return copy;
}

TEST(FsdpOffload, TrainsBitwiseAsWithoutAndTheStatesLoadIntoEachOther) {
  torch::set_num_threads(1);
  const Shape shape;
  for (const bool bf16 : {false, true}) {
    SCOPED_TRACE(bf16 ? "bf16 model" : "fp32 model");
    const at::ScalarType dtype = bf16 ? at::kBFloat16 : at::kFloat;
    const Scenario s{.name = "offload", .micro_steps = 2, .clip = 0.5, .bf16 = bf16, .steps = 3};
    expect_all_ok(run_threads(2, [&](Rank& r) {
      auto group = make_group(r);
      auto plain_model = make_model(shape, dtype, true);
      FullyShardedDataParallel plain(plain_model, *group);
      plain.set_optimizer(make_flat_optimizer(s));
      auto offload_model = make_model(shape, dtype, true);
      FullyShardedDataParallel offload(offload_model, *group, {.offload_optimizer_state = true});
      offload.set_optimizer(make_flat_optimizer(s));

      const FsdpMemory m = offload.memory();
      EXPECT_EQ(m.optimizer_bytes, 0) << "nothing of the optimizer on the parameters' device";
      EXPECT_EQ(m.offloaded_optimizer_bytes, offload.optimizer_state_bytes());
      // AdamW's two moments and an fp32 master per shard element.
      EXPECT_EQ(m.offloaded_optimizer_bytes,
                plain.memory().optimizer_bytes + (bf16 ? 0 : plain.optimizer_state_bytes() / 2));

      train(plain, *plain_model, r.rank, 2, s);
      train(offload, *offload_model, r.rank, 2, s);
      const Parameters expected = plain.gather_full_parameters();
      for (const auto& [name, tensor] : offload.gather_full_parameters()) {
        EXPECT_TRUE(tensor.equal(expected.at(name))) << name;
      }
      ckpt::State plain_state, offload_state;
      plain.add_state(plain_state);
      offload.add_state(offload_state);
      expect_same_tensors(offload_state, plain_state, "offloaded state against the plain run's");

      // Each run continues from the other's state, one more step, still bitwise together.
      const ckpt::State plain_copy = deep_copy(plain_state),
                        offload_copy = deep_copy(offload_state);
      offload.load_state(plain_copy);
      plain.load_state(offload_copy);
      const Scenario more{.name = "more", .clip = 0.5, .bf16 = bf16, .steps = 1};
      train(plain, *plain_model, r.rank, 2, more);
      train(offload, *offload_model, r.rank, 2, more);
      ckpt::State plain_after, offload_after;
      plain.add_state(plain_after);
      offload.add_state(offload_after);
      expect_same_tensors(offload_after, plain_after, "after loading each other's state");
    }));
  }
}

// --- bad input --------------------------------------------------------------------------------

struct Holder : torch::nn::Module {};

// A module with a unit inside it, for a unit around it.
struct NestImpl : torch::nn::Module {
  NestImpl() : inner(register_module("inner", FsdpUnit(Block(8, 8)))) {}
  at::Tensor forward(const at::Tensor& x) { return inner(x); }
  FsdpUnit inner;
};
TORCH_MODULE(Nest);

std::string construction_error(std::shared_ptr<torch::nn::Module> model) {
  std::string message;
  expect_all_ok(run_threads(1, [&](Rank& r) {
    auto group = make_group(r);
    message = loom::testing::error_of<InvalidArgument>(
        [&] { FullyShardedDataParallel fsdp(model, *group); });
  }));
  return message;
}

// As for DataParallel: a corrupt 'optim' blob is CorruptData quoting it, not nlohmann's error.
TEST(FsdpBadInput, ACorruptOptimBlobIsCorruptDataQuotingIt) {
  torch::set_num_threads(1);
  expect_all_ok(run_threads(1, [&](Rank& r) {
    auto group = make_group(r);
    auto model = make_model(Shape{}, at::kFloat, true);
    FullyShardedDataParallel fsdp(model, *group);
    fsdp.set_optimizer(std::make_unique<optim::AdamW>());
    for (const auto& [blob, cause] : loom::testing::parallel::corrupt_optim_blobs()) {
      SCOPED_TRACE(blob);
      ckpt::State state;
      fsdp.add_state(state);
      state.blobs["optim"] = blob;
      EXPECT_EQ(loom::testing::error_of<CorruptData>([&] { fsdp.load_state(state); }),
                "FSDP::load_state: the 'optim' blob is corrupt (" + cause + "): " + blob);
    }
  }));
}

TEST(FsdpBadInput, AUnitInsideAnotherUnitIsNamed) {
  auto model = std::make_shared<Holder>();
  model->register_module("outer", FsdpUnit(Nest()));
  const std::string message = construction_error(model);
  EXPECT_NE(message.find("the unit 'outer.inner' is inside the unit 'outer'"), std::string::npos)
      << message;
}

TEST(FsdpBadInput, AModuleInTwoUnitsIsNamed) {
  Block a(8, 8), b(8, 8);
  b->fc = b->replace_module("fc", a->fc);
  auto model = std::make_shared<Holder>();
  model->register_module("a", FsdpUnit(a));
  model->register_module("b", FsdpUnit(b));
  const std::string message = construction_error(model);
  EXPECT_NE(message.find("module 'b.fc' (also at 'a.fc') is in unit 'b' and in unit 'a'"),
            std::string::npos)
      << message;
}

TEST(FsdpBadInput, AParameterSharedBetweenUnitsIsNamed) {
  Block a(8, 8), b(8, 8);
  b->register_parameter("tied", a->fc->weight);
  auto model = std::make_shared<Holder>();
  model->register_module("a", FsdpUnit(a));
  model->register_module("b", FsdpUnit(b));
  model->register_module("head", torch::nn::Linear(8, 2));
  const std::string message = construction_error(model);
  EXPECT_NE(message.find("parameter 'b.tied' (also 'a.fc.weight') is shared between unit 'b' and "
                         "unit 'a'"),
            std::string::npos)
      << message;
  auto rooted = std::make_shared<Holder>();
  Block c(8, 8);
  rooted->register_module("c", FsdpUnit(c));
  rooted->register_parameter("tied", c->fc->bias);
  const std::string root_message = construction_error(rooted);
  EXPECT_NE(root_message.find(
                "parameter 'c.fc.bias' (also 'tied') is shared between unit 'c' and the root unit"),
            std::string::npos)
      << root_message;
}

TEST(FsdpBadInput, AUnitMarkedTwiceIsNamed) {
  FsdpUnit unit(Block(8, 8));
  auto model = std::make_shared<Holder>();
  model->register_module("first", unit);
  model->register_module("second", unit);
  std::string message = construction_error(model);
  EXPECT_NE(message.find("the unit at 'second' is marked twice: the same FsdpUnit is also at "
                         "'first'"),
            std::string::npos)
      << message;
  Block block(8, 8);
  auto wrapped_twice = std::make_shared<Holder>();
  wrapped_twice->register_module("first", FsdpUnit(block));
  wrapped_twice->register_module("second", FsdpUnit(block));
  message = construction_error(wrapped_twice);
  EXPECT_NE(message.find("is wrapped by two units, 'first' and 'second'"), std::string::npos)
      << message;
  message =
      loom::testing::error_of<InvalidArgument>([&] { std::make_shared<FsdpUnitImpl>(unit.ptr()); });
  EXPECT_NE(message.find("already an FsdpUnit"), std::string::npos) << message;
}

TEST(FsdpBadInput, ANonFloatingParamDtypeIsNamed) {
  expect_all_ok(run_threads(1, [](Rank& r) {
    auto group = make_group(r);
    auto model = make_model(Shape{}, at::kFloat, true);
    const std::string message = loom::testing::error_of<InvalidArgument>(
        [&] { FullyShardedDataParallel fsdp(model, *group, {.param_dtype = at::kLong}); });
    EXPECT_NE(message.find("FSDP: param_dtype must be a floating-point dtype, got int64"),
              std::string::npos)
        << message;
  }));
  std::string message = loom::testing::error_of<InvalidArgument>(
      [] { FsdpUnit(Block(8, 8), FsdpUnitOptions{.param_dtype = at::kInt}); });
  EXPECT_NE(message.find("FsdpUnit: param_dtype must be a floating-point dtype, got int32"),
            std::string::npos)
      << message;
  FsdpUnit unit(Block(8, 8));
  message = loom::testing::error_of<InvalidArgument>(
      [&] { unit->set_options({.reduce_dtype = at::kBool}); });
  EXPECT_NE(message.find("FsdpUnit: reduce_dtype must be a floating-point dtype, got bool"),
            std::string::npos)
      << message;
}

TEST(FsdpBadInput, MismatchedModelsAreAnErrorNamingRankAndParameter) {
  expect_all_ok(run_threads(2, [](Rank& r) {
    auto group = make_group(r);
    auto model = make_model(Shape{.hidden = r.rank == 0 ? 16 : 12}, at::kFloat, true);
    const std::string message = loom::testing::error_of<InvalidArgument>([&] {
      FullyShardedDataParallel fsdp(model, *group, {.timeout = std::chrono::seconds(20)});
    });
    EXPECT_NE(message.find("rank 1"), std::string::npos) << message;
    EXPECT_NE(message.find("blocks.0.fc.weight|float32|[16, 8]|blocks.0"), std::string::npos)
        << message;
    EXPECT_NE(message.find("blocks.0.fc.weight|float32|[12, 8]|blocks.0"), std::string::npos)
        << message;
  }));
}

// A rank that runs forward but not backward: its peer's pre-backward gather times out naming
// the unit.
TEST(FsdpBadInput, ARankSkippingBackwardTimesOutNamingTheUnit) {
  torch::set_num_threads(1);
  expect_all_ok(run_threads(2, [](Rank& r) {
    auto group = make_group(r);
    auto model = make_model(Shape{}, at::kFloat, true);
    FullyShardedDataParallel fsdp(model, *group, {.timeout = std::chrono::seconds(2)});
    const auto [x, y] = global_batch(0, 2, Scenario{});
    const at::Tensor loss = loss_of(*model, x, y, at::kFloat);
    if (r.rank == 1) return;
    const std::string message = loom::testing::error_of<std::exception>([&] { loss.backward(); });
    EXPECT_NE(message.find("gathering the parameters of unit 2 'blocks.2'"), std::string::npos)
        << message;
  }));
}

}  // namespace
}  // namespace loom::parallel
