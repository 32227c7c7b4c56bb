// parallel::checkpoint and ActivationCheckpoint: outputs, every gradient and the generator state
// bitwise equal to the uncheckpointed run (dropout on), the ModuleList and Sequential policy
// (names, identity, AdamW training), DataParallel and FSDP on top (ranks as threads), lower peak
// activation memory, and bad input.

#include "loom/parallel/activation_checkpoint.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ATen/CPUGeneratorImpl.h>

#include <chrono>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "harness/harness.h"
#include "loom/comm/gloo.h"
#include "loom/error.h"
#include "loom/metrics/allocations.h"
#include "loom/parallel/data_parallel.h"
#include "loom/parallel/fsdp.h"
#include "unit/parallel/equivalence.h"

namespace loom::parallel {
namespace {

using loom::testing::error_of;
using loom::testing::expect_all_ok;
using loom::testing::Rank;
using loom::testing::run_threads;
using loom::testing::parallel::global_batch;
using loom::testing::parallel::make_flat_optimizer;
using loom::testing::parallel::rows_of;
using loom::testing::parallel::Scenario;

// A transformer-like residual MLP block: x + dropout(fc2(dropout(gelu(fc1(norm(x)))))).
struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t width, double dropout)
      : norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})))),
        fc1(register_module("fc1", torch::nn::Linear(width, 4 * width))),
        fc2(register_module("fc2", torch::nn::Linear(4 * width, width))),
        drop(register_module("drop", torch::nn::Dropout(dropout))) {}
  at::Tensor forward(const at::Tensor& x) { return x + drop(fc2(drop(torch::gelu(fc1(norm(x)))))); }
  torch::nn::LayerNorm norm;
  torch::nn::Linear fc1, fc2;
  torch::nn::Dropout drop;
};
TORCH_MODULE(Block);

// An element of a ModuleList model: a Block, a Block checkpointed, or a Linear (never wrapped).
at::Tensor forward_element(const std::shared_ptr<torch::nn::Module>& m, const at::Tensor& x) {
  if (auto* checkpointed = m->as<ActivationCheckpointImpl>()) return checkpointed->forward(x);
  if (auto* block = m->as<BlockImpl>()) return block->forward(x);
  return m->as<torch::nn::LinearImpl>()->forward(x);
}

struct Shape {
  int blocks = 3;
  int64_t width = 8;
  double dropout = 0.1;
};

// blocks: Block, Linear, Block, Block, ... (the Linear after the first block); head to 4.
struct ListModel : torch::nn::Module {
  explicit ListModel(const Shape& shape) {
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int b = 0; b < shape.blocks; ++b) {
      blocks->push_back(Block(shape.width, shape.dropout));
      if (b == 0) blocks->push_back(torch::nn::Linear(shape.width, shape.width));
    }
    head = register_module("head", torch::nn::Linear(shape.width, 4));
  }
  at::Tensor forward(at::Tensor x) {
    for (const auto& m : *blocks) x = forward_element(m, x);
    return head(x);
  }
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::Linear head{nullptr};
};

struct SequentialModel : torch::nn::Module {
  explicit SequentialModel(const Shape& shape) {
    blocks = register_module("blocks", torch::nn::Sequential());
    for (int b = 0; b < shape.blocks; ++b) {
      blocks->push_back("block" + std::to_string(b), Block(shape.width, shape.dropout));
      if (b == 0) blocks->push_back(torch::nn::Linear(shape.width, shape.width));
    }
    head = register_module("head", torch::nn::Linear(shape.width, 4));
  }
  at::Tensor forward(const at::Tensor& x) { return head(blocks->forward(x)); }
  torch::nn::Sequential blocks{nullptr};
  torch::nn::Linear head{nullptr};
};

// Deterministic parameters by name order (independent of torch's global generator).
void initialize(torch::nn::Module& model) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1234);
  torch::NoGradGuard no_grad;
  for (auto& item : model.named_parameters()) {
    at::Tensor& p = item.value();
    p.copy_(at::randn(p.sizes(), gen) * (0.5 / std::sqrt(static_cast<double>(p.size(-1)))));
  }
}

template <class Model>
std::shared_ptr<Model> make(const Shape& shape) {
  auto model = std::make_shared<Model>(shape);
  initialize(*model);
  return model;
}

using Tensors = std::map<std::string, at::Tensor>;

Tensors parameters_of(torch::nn::Module& model) {
  Tensors out;
  for (const auto& item : model.named_parameters()) out[item.key()] = item.value().detach().clone();
  return out;
}

Tensors gradients_of(torch::nn::Module& model) {
  Tensors out;
  for (const auto& item : model.named_parameters()) {
    EXPECT_TRUE(item.value().grad().defined()) << item.key() << " got no gradient";
    out[item.key()] = item.value().grad().clone();
  }
  return out;
}

void expect_equal(const Tensors& actual, const Tensors& expected, const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  for (const auto& [name, reference] : expected) {
    ASSERT_EQ(actual.count(name), 1u) << what << ": no " << name;
    EXPECT_TRUE(actual.at(name).equal(reference)) << what << ": " << name << " differs";
  }
}

void zero_gradients(torch::nn::Module& model) {
  for (at::Tensor& p : model.parameters()) p.mutable_grad() = at::Tensor();
}

// What one forward and backward in train mode produced: the output, every parameter's
// gradient, the input's gradient, and numbers drawn from the CPU generator afterwards.
struct RunResult {
  at::Tensor output;
  Tensors gradients;
  at::Tensor input_gradient;
  at::Tensor drawn_after;
};

RunResult forward_backward(torch::nn::Module& model,
                           const std::function<at::Tensor(const at::Tensor&)>& forward) {
  zero_gradients(model);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  const at::Tensor x = at::randn({6, 8}, gen).requires_grad_(true);
  const at::Tensor weights = at::randn({6, 8}, gen);
  torch::manual_seed(7);
  RunResult run;
  run.output = forward(x);
  (run.output * weights.narrow(1, 0, run.output.size(1))).sum().backward();
  run.gradients = gradients_of(model);
  run.input_gradient = x.grad().clone();
  run.drawn_after = torch::rand({4});
  return run;
}

void expect_same_run(const RunResult& checkpointed, const RunResult& plain,
                     const std::string& what) {
  EXPECT_TRUE(checkpointed.output.equal(plain.output)) << what << ": output";
  expect_equal(checkpointed.gradients, plain.gradients, what + ": gradients");
  EXPECT_TRUE(checkpointed.input_gradient.equal(plain.input_gradient)) << what << ": input grad";
  EXPECT_TRUE(checkpointed.drawn_after.equal(plain.drawn_after))
      << what << ": the generator after backward is not where the plain run leaves it";
}

Block make_block(double dropout) {
  Block block(8, dropout);
  initialize(*block);
  return block;
}

// --- a. one block: the module, the function and the several-tensor form ----------------------

TEST(ActivationCheckpoint, BlockWithDropoutMatchesPlainBitwise) {
  torch::set_num_threads(1);
  Block block = make_block(0.2);
  const RunResult plain = forward_backward(*block, [&](const at::Tensor& x) { return block(x); });
  ActivationCheckpoint checkpointed(block);
  const RunResult run =
      forward_backward(*block, [&](const at::Tensor& x) { return checkpointed(x); });
  expect_same_run(run, plain, "ActivationCheckpoint(block)");

  // Not vacuous: dropout draws (another seed, another output), and the input gets a gradient.
  const at::Tensor x = at::randn({6, 8});
  torch::NoGradGuard no_grad;
  torch::manual_seed(7);
  const at::Tensor seven = block(x);
  torch::manual_seed(8);
  EXPECT_FALSE(block(x).equal(seven)) << "dropout is off: the test would not see the replay";
  EXPECT_GT(plain.input_gradient.abs().sum().item<double>(), 0);
}

TEST(ActivationCheckpoint, FunctionRecomputesInBackwardWithTheForwardsDropoutMask) {
  torch::set_num_threads(1);
  Block block = make_block(0.2);
  int calls = 0;
  const CheckpointFn fn = [&](const at::Tensor& x) {
    ++calls;
    return block->forward(x);
  };
  const RunResult plain = forward_backward(*block, [&](const at::Tensor& x) { return fn(x); });
  ASSERT_EQ(calls, 1);
  const RunResult run =
      forward_backward(*block, [&](const at::Tensor& x) { return checkpoint(fn, x); });
  EXPECT_EQ(calls, 3) << "one forward under no-grad and one recompute in backward";
  expect_same_run(run, plain, "checkpoint(fn, x)");
}

TEST(ActivationCheckpoint, SeveralInputsAndOutputsMatchPlainBitwise) {
  torch::set_num_threads(1);
  Block block = make_block(0.2);
  const CheckpointVectorFn fn = [&](const std::vector<at::Tensor>& in) {
    const at::Tensor h = block(in[0]) * in[1];
    return std::vector<at::Tensor>{h, torch::dropout(h + in[1], 0.5, /*train=*/true)};
  };
  const auto run_with = [&](bool checkpointed) {
    zero_gradients(*block);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
    const at::Tensor a = at::randn({6, 8}, gen).requires_grad_(true);
    const at::Tensor b = at::randn({6, 8}, gen).requires_grad_(true);
    torch::manual_seed(11);
    const auto out = checkpointed ? checkpoint(fn, {a, b}) : fn({a, b});
    (out[0].sum() + (out[1] * out[1]).sum()).backward();
    Tensors result = gradients_of(*block);
    result["<out0>"] = out[0].detach();
    result["<out1>"] = out[1].detach();
    result["<a.grad>"] = a.grad();
    result["<b.grad>"] = b.grad();
    result["<drawn after>"] = torch::rand({4});
    return result;
  };
  const Tensors plain = run_with(false);
  expect_equal(run_with(true), plain, "checkpoint(fn, {a, b})");
}

// --- b. the policy on a ModuleList and a Sequential ------------------------------------------

template <class Model>
void check_policy_and_training(const std::string& what) {
  torch::set_num_threads(1);
  const Shape shape{.blocks = 3};
  auto plain = make<Model>(shape);
  auto wrapped = make<Model>(shape);
  std::vector<std::pair<std::string, at::Tensor>> before;
  for (const auto& item : wrapped->named_parameters())
    before.emplace_back(item.key(), item.value());
  const size_t elements = wrapped->blocks->size();

  EXPECT_EQ(checkpoint_modules_of_type<BlockImpl>(*wrapped, wrapped->blocks), shape.blocks);

  // The same names, in the same order, and the very same tensors.
  const auto after = wrapped->named_parameters();
  ASSERT_EQ(after.size(), before.size()) << what;
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_EQ(after[i].key(), before[i].first) << what;
    EXPECT_TRUE(after[i].value().is_same(before[i].second)) << what << ": " << before[i].first;
  }
  std::vector<std::string> plain_names;
  for (const auto& item : plain->named_parameters()) plain_names.push_back(item.key());
  EXPECT_EQ(after.keys(), plain_names) << what;
  // The container registered under the parent is the one the member points to; the blocks are
  // wrapped, the Linear is not.
  EXPECT_EQ(wrapped->named_children()["blocks"].get(), wrapped->blocks.ptr().get()) << what;
  ASSERT_EQ(wrapped->blocks->size(), elements) << what;
  int checkpointed = 0;
  for (size_t i = 0; i < elements; ++i) {
    if (auto* ac = wrapped->blocks->ptr(i)->template as<ActivationCheckpointImpl>()) {
      EXPECT_NE(std::dynamic_pointer_cast<BlockImpl>(ac->module()), nullptr) << what;
      ++checkpointed;
    } else {
      EXPECT_NE(wrapped->blocks->ptr(i)->template as<torch::nn::LinearImpl>(), nullptr) << what;
    }
  }
  EXPECT_EQ(checkpointed, shape.blocks) << what;

  // Training with dropout on: bitwise the plain model's, and the generator ends where it does.
  const Scenario s{.name = what, .rows = 8};
  at::Tensor drawn[2];
  for (bool checkpoint_on : {false, true}) {
    Model& model = checkpoint_on ? *wrapped : *plain;
    torch::optim::AdamW opt(model.parameters(),
                            torch::optim::AdamWOptions(1e-2).weight_decay(1e-2));
    for (int step = 0; step < 4; ++step) {
      const auto [x, y] = global_batch(step, 1, s);
      opt.zero_grad();
      torch::manual_seed(100 + step);
      (model.forward(x) - y).square().mean().backward();
      opt.step();
    }
    drawn[checkpoint_on] = torch::rand({4});
  }
  const Tensors trained = parameters_of(*plain);
  expect_equal(parameters_of(*wrapped), trained, what + ": trained parameters");
  EXPECT_TRUE(drawn[1].equal(drawn[0])) << what << ": generator after training";
  auto untrained = make<Model>(shape);
  EXPECT_FALSE(
      trained.at(plain_names.front()).equal(parameters_of(*untrained).at(plain_names.front())))
      << what << ": training did not move the parameters";
}

TEST(ActivationCheckpoint, ModuleListPolicyKeepsNamesAndTrainsLikePlainWithAdamW) {
  check_policy_and_training<ListModel>("ModuleList");
}

TEST(ActivationCheckpoint, SequentialPolicyKeepsNamesAndTrainsLikePlainWithAdamW) {
  check_policy_and_training<SequentialModel>("Sequential");
}

// --- c. under DataParallel and FSDP ----------------------------------------------------------

// Ranks run as threads here and share the process-wide CPU generator, so their dropout draws
// would interleave in whatever order the threads run: the multi-rank models use dropout p = 0,
// which draws nothing (the replay itself is checked single-process above).
const Shape kMultiRankShape{.blocks = 3, .dropout = 0.0};

std::unique_ptr<comm::Group> make_group(Rank& r) {
  comm::GlooOptions options;
  options.connect_timeout = std::chrono::seconds(20);
  return comm::new_gloo_group(r.store, r.rank, r.world, options);
}

TEST(ActivationCheckpoint, UnderDataParallelTrainsLikeWithout) {
  torch::set_num_threads(1);
  const Scenario s{.name = "dp", .steps = 3};
  expect_all_ok(run_threads(2, [&](Rank& r) {
    auto group = make_group(r);
    Tensors results[2];
    for (bool checkpointed : {false, true}) {
      auto model = make<ListModel>(kMultiRankShape);
      if (checkpointed) {
        EXPECT_EQ(checkpoint_modules_of_type<BlockImpl>(*model, model->blocks), 3);
      }
      DataParallel dp(model, *group, {.bucket_bytes = 512, .timeout = std::chrono::seconds(60)});
      EXPECT_GT(dp.bucket_count(), 1);
      dp.set_optimizer(make_flat_optimizer(s));
      for (int step = 0; step < s.steps; ++step) {
        const auto [x, y] = global_batch(step, 2, s);
        dp.zero_grad();
        (model->forward(rows_of(x, r.rank, 0, s)) - rows_of(y, r.rank, 0, s))
            .square()
            .mean()
            .backward();
        dp.finish_gradient_sync();
        dp.step();
      }
      results[checkpointed] = parameters_of(*model);
    }
    expect_equal(results[1], results[0], "DataParallel with and without checkpointing");
    const Tensors initial = parameters_of(*make<ListModel>(kMultiRankShape));
    EXPECT_FALSE(results[0].at("blocks.0.fc1.weight").equal(initial.at("blocks.0.fc1.weight")));
  }));
}

TEST(ActivationCheckpoint, InsideFsdpUnitsTrainsLikeWithout) {
  torch::set_num_threads(1);
  const Scenario s{.name = "fsdp", .steps = 3};
  expect_all_ok(run_threads(2, [&](Rank& r) {
    auto group = make_group(r);
    Tensors results[2];
    for (bool checkpointed : {false, true}) {
      auto model = make<SequentialModel>(kMultiRankShape);
      if (checkpointed) {
        EXPECT_EQ(checkpoint_modules_of_type<BlockImpl>(*model, model->blocks), 3);
        EXPECT_EQ(wrap_modules<ActivationCheckpointImpl>(model->blocks), 3);
      } else {
        EXPECT_EQ(wrap_modules<BlockImpl>(model->blocks), 3);
      }
      FullyShardedDataParallel fsdp(model, *group);
      EXPECT_EQ(fsdp.unit_count(), 4);  // a unit per block, and the root (the Linear, the head)
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
      results[checkpointed] = fsdp.gather_full_parameters();
    }
    expect_equal(results[1], results[0], "FSDP units with and without checkpointing inside");
    const Tensors initial = parameters_of(*make<SequentialModel>(kMultiRankShape));
    const std::string name = "blocks.block1.fc1.weight";
    EXPECT_FALSE(results[0].at(name).equal(initial.at(name)));
  }));
}

// --- d. memory -------------------------------------------------------------------------------

// Peak bytes allocated under kActivations during one forward and backward of a deep stack.
// The gradients exist beforehand (zeros, in place of accumulating into new ones), so the peak
// is the activations' and the backward's temporaries'.
int64_t peak_activation_bytes(bool checkpointed) {
  const Shape shape{.blocks = 16, .width = 64, .dropout = 0.1};
  auto model = make<ListModel>(shape);
  if (checkpointed) {
    EXPECT_EQ(checkpoint_modules_of_type<BlockImpl>(*model, model->blocks), shape.blocks);
  }
  {
    metrics::MemoryCategoryScope scope(metrics::MemoryCategory::kGradients);
    for (at::Tensor& p : model->parameters()) p.mutable_grad() = at::zeros_like(p);
  }
  const at::Tensor x = at::randn({128, 64});
  metrics::reset_cpu_allocation_peaks();
  const int64_t live =
      metrics::cpu_allocations().of(metrics::MemoryCategory::kActivations).live_bytes;
  {
    metrics::MemoryCategoryScope scope(metrics::MemoryCategory::kActivations);
    torch::manual_seed(3);
    model->forward(x).square().mean().backward();
  }
  return metrics::cpu_allocations().of(metrics::MemoryCategory::kActivations).peak_bytes - live;
}

TEST(ActivationCheckpoint, LowersPeakActivationMemory) {
  torch::set_num_threads(1);  // allocations in intra-op worker threads would count as kOther
  metrics::count_cpu_allocations();
  const int64_t plain = peak_activation_bytes(false);
  const int64_t checkpointed = peak_activation_bytes(true);
  std::cout << "peak activation bytes, 16 blocks of width 64, 128 rows: plain " << plain
            << ", checkpointed " << checkpointed << "\n";
  EXPECT_GT(plain, 0);
  EXPECT_LT(checkpointed, plain);
}

// --- e. bad input ----------------------------------------------------------------------------

TEST(ActivationCheckpoint, NullModuleIsInvalidArgument) {
  for (const std::string& message : {
           error_of<InvalidArgument>([] { ActivationCheckpoint wrapped{Block(nullptr)}; }),
           error_of<InvalidArgument>(
               [] { ActivationCheckpoint wrapped{std::shared_ptr<BlockImpl>()}; }),
           error_of<InvalidArgument>([] { ActivationCheckpoint wrapped{torch::nn::AnyModule()}; }),
       }) {
    EXPECT_TRUE(
        loom::testing::contains(message, "ActivationCheckpoint: the module to wrap is null"))
        << message;
  }
}

TEST(ActivationCheckpoint, PolicyOnAContainerThatIsNotAChildIsInvalidArgument) {
  auto model = make<ListModel>(Shape{});
  torch::nn::ModuleList stray;
  stray->push_back(Block(8, 0.0));
  std::string message =
      error_of<InvalidArgument>([&] { checkpoint_modules_of_type<BlockImpl>(*model, stray); });
  EXPECT_TRUE(loom::testing::contains(message, "is not a direct child of")) << message;
  EXPECT_NE(stray->ptr(0)->as<BlockImpl>(), nullptr) << "the list must be left as it was";

  auto sequential_model = make<SequentialModel>(Shape{});
  torch::nn::Sequential stray_sequential(Block(8, 0.0));
  message = error_of<InvalidArgument>(
      [&] { checkpoint_modules_of_type<BlockImpl>(*sequential_model, stray_sequential); });
  EXPECT_TRUE(loom::testing::contains(message, "is not a direct child of")) << message;
  EXPECT_NE(stray_sequential->ptr(0)->as<BlockImpl>(), nullptr);
  EXPECT_NE(sequential_model->blocks->ptr(0)->as<BlockImpl>(), nullptr);
}

}  // namespace
}  // namespace loom::parallel
