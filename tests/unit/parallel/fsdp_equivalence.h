// FullyShardedDataParallel against single-process torch::optim, shared by the threaded unit
// tests (fsdp_test.cpp) and the process tests (tests/integration/parallel_fsdp_test.cpp): a
// model of blocks (each an FSDP unit) and a head in the root unit, the reference training on
// the concatenated batch, and the scenarios (accumulation, clipping, bf16 parameters, the
// mixed-precision policy, reduction in fp32, kept-gathered units without prefetch).
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ATen/CPUGeneratorImpl.h>

#include <chrono>
#include <cmath>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "loom/comm/group.h"
#include "loom/parallel/fsdp.h"
#include "unit/parallel/equivalence.h"

namespace loom::testing::fsdp {

using loom::parallel::FsdpOptions;
using loom::parallel::FsdpUnitImpl;
using loom::parallel::FullyShardedDataParallel;
using loom::parallel::wrap_modules;
using loom::testing::parallel::adamw_options;
using loom::testing::parallel::expect_close_per_element;
using loom::testing::parallel::global_batch;
using loom::testing::parallel::make_flat_optimizer;
using loom::testing::parallel::rank_average_gradients;
using loom::testing::parallel::relative_error;
using loom::testing::parallel::rows_of;
using loom::testing::parallel::Scenario;
using loom::testing::parallel::sgd_options;
using Parameters = std::map<std::string, at::Tensor>;

// A block with the common signature; the test model is a Sequential of them plus a head that
// is in no unit (the root unit).
struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t in, int64_t out) : fc(register_module("fc", torch::nn::Linear(in, out))) {}
  at::Tensor forward(const at::Tensor& x) { return torch::tanh(fc(x)); }
  torch::nn::Linear fc;
};
TORCH_MODULE(Block);

struct Shape {
  int blocks = 3;
  int64_t hidden = 16;
};

struct BlockMlp : torch::nn::Module {
  explicit BlockMlp(const Shape& shape) {
    blocks = register_module("blocks", torch::nn::Sequential());
    for (int b = 0; b < shape.blocks; ++b)
      blocks->push_back(Block(b == 0 ? 8 : shape.hidden, shape.hidden));
    head = register_module("head", torch::nn::Linear(shape.hidden, 4));
  }
  at::Tensor forward(const at::Tensor& x) { return head(blocks->forward(x)); }
  torch::nn::Sequential blocks{nullptr};
  torch::nn::Linear head{nullptr};
};

// Deterministic parameters by name, the same for the wrapped and the unwrapped model.
inline std::shared_ptr<BlockMlp> make_model(const Shape& shape, at::ScalarType dtype, bool wrap) {
  auto model = std::make_shared<BlockMlp>(shape);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1234);
  torch::NoGradGuard no_grad;
  for (auto& item : model->named_parameters()) {
    at::Tensor& p = item.value();
    p.copy_(at::randn(p.sizes(), gen) * 0.3 * std::sqrt(8.0 / static_cast<double>(p.size(-1))));
  }
  model->to(dtype);
  if (wrap) {
    EXPECT_EQ(wrap_modules<BlockImpl>(model->blocks), shape.blocks);
  }
  return model;
}

inline at::Tensor loss_of(BlockMlp& model, const at::Tensor& x, const at::Tensor& y,
                          at::ScalarType dtype) {
  return (model.forward(x.to(dtype)) - y.to(dtype)).square().mean();
}

struct Reference {
  bool reduce_fp32 = false;  // the bf16 gradients are averaged in fp32, not rounded
  bool mixed = false;        // the param_dtype = bf16 policy on the fp32 model
  bool per_rank = true;      // bf16: each rank's gradient rounded, then averaged; else one backward
};

// equivalence.h's reference_training on the block model: torch::optim on the concatenated
// batch; bf16 as the ranks compute it (per-rank bf16 gradients averaged in fp32, rounded once).
// reduce_fp32: the bf16 gradients are averaged in fp32 and not rounded (FsdpOptions::reduce_dtype).
// mixed: the masters are the fp32 model's parameters, forward and backward run on their bf16
// copies (rounded from the masters every step), and the masters are returned. !per_rank: the
// bf16 gradient of the concatenated batch in one backward, converted to fp32 (no accumulation).
inline Parameters reference_training(int world, const Scenario& s, const Shape& shape,
                                     const Reference& how = {}) {
  const bool bf16 = s.bf16 || how.mixed;
  const at::ScalarType dtype = bf16 ? at::kBFloat16 : at::kFloat;
  auto model = make_model(shape, dtype, /*wrap=*/false);
  std::vector<at::Tensor> params = model->parameters();
  std::vector<at::Tensor> masters;
  if (how.mixed) {
    for (const at::Tensor& p : make_model(shape, at::kFloat, /*wrap=*/false)->parameters())
      masters.push_back(p.detach().clone().requires_grad_(true));
  } else {
    for (const at::Tensor& p : params)
      masters.push_back(p.detach().to(at::kFloat).requires_grad_(true));
  }
  std::vector<at::Tensor>& stepped = bf16 ? masters : params;
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (s.adamw) {
    const auto o = adamw_options();
    opt = std::make_unique<torch::optim::AdamW>(
        stepped, torch::optim::AdamWOptions(o.lr).eps(o.eps).weight_decay(o.weight_decay));
  } else {
    const auto o = sgd_options();
    opt = std::make_unique<torch::optim::SGD>(
        stepped, torch::optim::SGDOptions(o.lr).momentum(o.momentum).weight_decay(o.weight_decay));
  }
  for (int step = 0; step < s.steps; ++step) {
    const auto [x, y] = global_batch(step, world, s);
    if (!bf16) {
      for (at::Tensor& p : params) p.mutable_grad() = at::Tensor();
      loss_of(*model, x, y, dtype).backward();
      if (s.clip > 0) torch::nn::utils::clip_grad_norm_(params, s.clip);
      opt->step();
      continue;
    }
    if (!how.per_rank) {
      for (at::Tensor& p : params) p.mutable_grad() = at::Tensor();
      loss_of(*model, x, y, dtype).backward();
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < params.size(); ++i)
        masters[i].mutable_grad() = params[i].grad().to(at::kFloat);
      if (s.clip > 0) torch::nn::utils::clip_grad_norm_(masters, s.clip);
      opt->step();
      for (size_t i = 0; i < params.size(); ++i) params[i].copy_(masters[i]);
      continue;
    }
    const std::vector<at::Tensor> average =
        rank_average_gradients(params, world, s, [&](int r, int m) {
          return loss_of(*model, rows_of(x, r, m, s), rows_of(y, r, m, s), dtype);
        });
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) {
      masters[i].mutable_grad() =
          how.reduce_fp32 ? average[i] : average[i].to(at::kBFloat16).to(at::kFloat);
    }
    if (s.clip > 0) torch::nn::utils::clip_grad_norm_(masters, s.clip);
    opt->step();
    for (size_t i = 0; i < params.size(); ++i) params[i].copy_(masters[i]);
  }
  Parameters out;
  const auto named = model->named_parameters();
  for (size_t i = 0; i < named.size(); ++i) {
    out[named[i].key()] = (how.mixed ? masters[i] : named[i].value()).detach().clone();
  }
  return out;
}

// The loss under a param_dtype policy: the fp32 input enters the first unit, which casts it.
inline at::Tensor policy_loss_of(BlockMlp& model, const at::Tensor& x, const at::Tensor& y,
                                 at::ScalarType param_dtype) {
  return (model.forward(x) - y.to(param_dtype)).square().mean();
}

// This rank's part of training the scenario with FSDP (no_sync for all but the last
// micro-step); returns the gathered parameters.
inline void train(FullyShardedDataParallel& fsdp, BlockMlp& model, int rank, int world,
                  const Scenario& s) {
  const at::ScalarType dtype = s.bf16 ? at::kBFloat16 : at::kFloat;
  const std::optional<at::ScalarType> policy = fsdp.options().param_dtype;
  for (int step = 0; step < s.steps; ++step) {
    const auto [x, y] = global_batch(step, world, s);
    fsdp.zero_grad();
    for (int m = 0; m < s.micro_steps; ++m) {
      fsdp.set_sync(m + 1 == s.micro_steps);
      const at::Tensor xs = rows_of(x, rank, m, s), ys = rows_of(y, rank, m, s);
      const at::Tensor loss =
          policy ? policy_loss_of(model, xs, ys, *policy) : loss_of(model, xs, ys, dtype);
      (loss / s.micro_steps).backward();
    }
    fsdp.finish_gradient_sync();
    if (s.clip > 0) fsdp.clip_grad_norm(s.clip);
    fsdp.step();
  }
}

inline Parameters train_fsdp(comm::Group& group, const Scenario& s, const Shape& shape,
                             const FsdpOptions& options) {
  auto model = make_model(shape, s.bf16 ? at::kBFloat16 : at::kFloat, /*wrap=*/true);
  if (group.rank() != 0) {  // the broadcast at construction must overwrite these
    torch::NoGradGuard no_grad;
    for (at::Tensor& p : model->parameters()) p.add_(1.0);
  }
  FullyShardedDataParallel fsdp(model, group, options);
  EXPECT_EQ(fsdp.unit_count(), shape.blocks + 1);
  fsdp.set_optimizer(make_flat_optimizer(s));
  train(fsdp, *model, group.rank(), group.size(), s);
  EXPECT_EQ(fsdp.step_count(), s.steps);
  EXPECT_EQ(model->blocks[0]->as<FsdpUnitImpl>()->named_parameters()["fc.weight"].numel(), 0)
      << "a unit's parameters are freed outside its forward and backward";
  return fsdp.gather_full_parameters();
}

// Bitwise when `rtol` is 0, else per element (expect_close_per_element).
inline void expect_match(const Parameters& actual, const Parameters& expected, double rtol,
                         const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  for (const auto& [name, reference] : expected) {
    const at::Tensor& got = actual.at(name);
    if (rtol == 0) {
      EXPECT_TRUE(got.equal(reference)) << what << ": " << name << " differs (bitwise expected), "
                                        << "relative error " << relative_error(got, reference);
    } else {
      expect_close_per_element(got, reference, what + ": " + name, rtol);
    }
  }
}

struct Case {
  Scenario scenario;
  FsdpOptions options;
};

inline std::vector<Case> cases() {
  std::vector<Case> out;
  out.push_back({{.name = "adamw"}, {}});
  out.push_back(
      {{.name = "sgd-accumulate-clip", .adamw = false, .micro_steps = 2, .clip = 0.05}, {}});
  out.push_back({{.name = "adamw-clip", .clip = 0.05}, {}});
  out.push_back({{.name = "adamw-bf16-accumulate", .micro_steps = 2, .bf16 = true}, {}});
  out.push_back({{.name = "adamw-bf16-reduce-fp32-accumulate", .micro_steps = 2, .bf16 = true},
                 {.reduce_dtype = at::kFloat}});
  out.push_back({{.name = "adamw-keep-gathered-no-prefetch"},
                 {.reshard_after_forward = false, .prefetch = false}});
  // The mixed-precision policy on the fp32 model: bf16 compute, fp32 shards as masters.
  out.push_back({{.name = "adamw-param-bf16"}, {.param_dtype = at::kBFloat16}});
  out.push_back({{.name = "adamw-param-bf16-keep-gathered", .clip = 0.05},
                 {.reshard_after_forward = false, .param_dtype = at::kBFloat16}});
  out.push_back({{.name = "adamw-param-bf16-reduce-fp32-accumulate", .micro_steps = 2},
                 {.param_dtype = at::kBFloat16, .reduce_dtype = at::kFloat}});
  // The optimizer state and fp32 masters in host memory, updated there.
  out.push_back({{.name = "adamw-offload"}, {.offload_optimizer_state = true}});
  out.push_back({{.name = "adamw-offload-accumulate-clip", .micro_steps = 2, .clip = 0.05},
                 {.offload_optimizer_state = true}});
  out.push_back({{.name = "adamw-bf16-offload-accumulate", .micro_steps = 2, .bf16 = true},
                 {.offload_optimizer_state = true}});
  return out;
}

// One rank's part of the check: every case of cases() trained with FSDP on `group`, against
// the reference computed on this rank; bitwise where DataParallel is (W = 1 without
// accumulation or clipping), else within 1e-6 per element (expect_close_per_element).
inline void check_equivalence(comm::Group& group) {
  const int world = group.size();
  const Shape shape;
  Parameters init;
  for (const auto& item : make_model(shape, at::kFloat, false)->named_parameters())
    init[item.key()] = item.value().detach().clone();
  for (Case c : cases()) {
    c.options.timeout = std::chrono::seconds(60);
    const Scenario& s = c.scenario;
    const Parameters expected =
        reference_training(world, s, shape,
                           {.reduce_fp32 = c.options.reduce_dtype.has_value(),
                            .mixed = c.options.param_dtype.has_value()});
    const Parameters actual = train_fsdp(group, s, shape, c.options);
    EXPECT_GT(relative_error(actual.at("blocks.1.fc.weight").to(at::kFloat),
                             init.at("blocks.1.fc.weight")),
              1e-3)
        << s.name << ": training moved the parameters";
    const bool bitwise = world == 1 && s.micro_steps == 1 && s.clip == 0;
    expect_match(actual, expected, bitwise ? 0.0 : 1e-6,
                 "fsdp/" + s.name + " at W=" + std::to_string(world));
  }
}

}  // namespace loom::testing::fsdp
