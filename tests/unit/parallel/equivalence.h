// Shared by the parallel unit tests (ranks as threads) and integration tests (ranks as
// processes): a small MLP, deterministic data, the single-process torch::optim reference, and
// the check that DataParallel (DDP, ZeRO-1, ZeRO-2) trains to the same parameters.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ATen/CPUGeneratorImpl.h>

#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "loom/comm/group.h"
#include "loom/parallel/data_parallel.h"

namespace loom::testing::parallel {

using loom::parallel::DataParallel;
using loom::parallel::ZeroStage;

struct Mlp : torch::nn::Module {
  explicit Mlp(int64_t hidden = 16) {
    fc1 = register_module("fc1", torch::nn::Linear(8, hidden));
    fc2 = register_module("fc2", torch::nn::Linear(hidden, hidden));
    fc3 = register_module("fc3", torch::nn::Linear(hidden, 4));
  }
  at::Tensor forward(const at::Tensor& x) { return fc3(torch::tanh(fc2(torch::tanh(fc1(x))))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};

// Deterministic initial parameters, by name (independent of torch's global generator).
inline std::map<std::string, at::Tensor> initial_parameters() {
  Mlp model;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1234);
  std::map<std::string, at::Tensor> values;
  for (const auto& item : model.named_parameters()) {
    values[item.key()] = at::randn(item.value().sizes(), gen) * 0.3;
  }
  return values;
}

inline std::shared_ptr<Mlp> make_model(at::ScalarType dtype = at::kFloat) {
  auto model = std::make_shared<Mlp>();
  const auto init = initial_parameters();
  torch::NoGradGuard no_grad;
  for (auto& item : model->named_parameters()) item.value().copy_(init.at(item.key()));
  model->to(dtype);
  return model;
}

struct Scenario {
  std::string name;
  ZeroStage stage = ZeroStage::kNone;
  bool adamw = true;             // else SGD with momentum
  bool torch_optimizer = false;  // kNone only: torch::optim on the module's parameters
  int micro_steps = 1;           // gradient accumulation
  double clip = 0;               // max norm; 0 = no clipping
  bool bf16 = false;             // bf16 parameters, fp32 masters
  int steps = 3;
  int64_t rows = 4;           // per rank per micro-step
  size_t bucket_bytes = 300;  // small: several buckets, some cutting through parameters' ranks
};

inline optim::AdamWOptions adamw_options() {
  return {.lr = 1e-2, .eps = 1e-6, .weight_decay = 1e-2};
}
inline optim::SgdOptions sgd_options() {
  return {.lr = 0.1, .momentum = 0.9, .weight_decay = 1e-3};
}

// The global batch of one step: world * micro_steps * rows rows.
inline std::pair<at::Tensor, at::Tensor> global_batch(int step, int world, const Scenario& s) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + step);
  const int64_t n = world * s.micro_steps * s.rows;
  return {at::randn({n, 8}, gen), at::randn({n, 4}, gen)};
}

// Rows of rank r's micro-step m.
inline at::Tensor rows_of(const at::Tensor& t, int rank, int micro, const Scenario& s) {
  return t.narrow(0, (rank * s.micro_steps + micro) * s.rows, s.rows);
}

inline at::Tensor loss_of(Mlp& model, const at::Tensor& x, const at::Tensor& y,
                          at::ScalarType dtype) {
  // Mean squared error, written out: mse_loss has no bf16 CPU kernel in libtorch 1.13.
  return (model.forward(x.to(dtype)) - y.to(dtype)).square().mean();
}

// The gradient the ranks reduce, computed in one process: rank r's micro-batches accumulate
// gradients of loss(r, m) / micro_steps in the parameters' dtype, as the rank does, and the
// ranks' gradients are summed in fp32 and divided by `world`. The parameters' .grad() is
// overwritten.
inline std::vector<at::Tensor> rank_average_gradients(
    std::vector<at::Tensor>& params, int world, const Scenario& s,
    const std::function<at::Tensor(int rank, int micro)>& loss) {
  std::vector<at::Tensor> sums;
  for (const at::Tensor& p : params) sums.push_back(at::zeros_like(p, at::kFloat));
  for (int r = 0; r < world; ++r) {
    for (at::Tensor& p : params) p.mutable_grad() = at::zeros_like(p);
    for (int m = 0; m < s.micro_steps; ++m) (loss(r, m) / s.micro_steps).backward();
    for (size_t i = 0; i < params.size(); ++i) sums[i] += params[i].grad().to(at::kFloat);
  }
  for (at::Tensor& sum : sums) sum /= world;
  return sums;
}

// Single-process training on the concatenated batch with torch::optim. For bf16, the
// reference is computed the way the ranks do it: each rank's micro-batches accumulate bf16
// gradients; they are averaged in fp32 and rounded to bf16 (what the all-reduce does), and
// torch::optim steps fp32 masters that are rounded into the bf16 parameters. The model and
// the batches live on `device` (the GPU tests' reference); the result is on the host.
inline std::map<std::string, at::Tensor> reference_training(int world, const Scenario& s,
                                                            const at::Device& device = at::kCPU) {
  const at::ScalarType dtype = s.bf16 ? at::kBFloat16 : at::kFloat;
  auto model = make_model(dtype);
  model->to(device);
  std::vector<at::Tensor> params = model->parameters();
  std::vector<at::Tensor> masters;
  for (const at::Tensor& p : params) {
    masters.push_back(p.detach().to(at::kFloat).requires_grad_(true));
  }
  std::vector<at::Tensor>& stepped = s.bf16 ? masters : params;
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
    const auto [host_x, host_y] = global_batch(step, world, s);
    const at::Tensor x = host_x.to(device), y = host_y.to(device);
    if (!s.bf16) {
      for (at::Tensor& p : params) p.mutable_grad() = at::Tensor();
      loss_of(*model, x, y, dtype).backward();
      if (s.clip > 0) torch::nn::utils::clip_grad_norm_(params, s.clip);
      opt->step();
      continue;
    }
    const std::vector<at::Tensor> average =
        rank_average_gradients(params, world, s, [&](int r, int m) {
          return loss_of(*model, rows_of(x, r, m, s), rows_of(y, r, m, s), dtype);
        });
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) {
      masters[i].mutable_grad() = average[i].to(at::kBFloat16).to(at::kFloat);
    }
    opt->step();
    for (size_t i = 0; i < params.size(); ++i) params[i].copy_(masters[i]);
  }
  std::map<std::string, at::Tensor> out;
  for (const auto& item : model->named_parameters())
    out[item.key()] = item.value().detach().cpu().clone();
  return out;
}

inline std::unique_ptr<optim::FlatOptimizer> make_flat_optimizer(const Scenario& s) {
  if (s.adamw) return std::make_unique<optim::AdamW>(adamw_options());
  return std::make_unique<optim::Sgd>(sgd_options());
}

// Trains `model` on this rank's share of the scenario's batches. The model must start from
// make_model's parameters (on rank 0 at least: DataParallel broadcasts them).
inline void train_data_parallel(DataParallel& dp, Mlp& model, int rank, int world,
                                const Scenario& s) {
  const at::ScalarType dtype = s.bf16 ? at::kBFloat16 : at::kFloat;
  std::unique_ptr<torch::optim::Optimizer> torch_opt;
  if (s.torch_optimizer) {
    const auto o = adamw_options();
    torch_opt = std::make_unique<torch::optim::AdamW>(
        model.parameters(),
        torch::optim::AdamWOptions(o.lr).eps(o.eps).weight_decay(o.weight_decay));
  } else {
    dp.set_optimizer(make_flat_optimizer(s));
  }
  for (int step = 0; step < s.steps; ++step) {
    const auto [x, y] = global_batch(step, world, s);
    dp.zero_grad();
    for (int m = 0; m < s.micro_steps; ++m) {
      const bool last = m + 1 == s.micro_steps;
      dp.set_sync(last);
      (loss_of(model, rows_of(x, rank, m, s), rows_of(y, rank, m, s), dtype) / s.micro_steps)
          .backward();
    }
    dp.finish_gradient_sync();
    if (s.clip > 0) dp.clip_grad_norm(s.clip);
    if (torch_opt) {
      torch_opt->step();
    } else {
      dp.step();
    }
  }
}

// max |a - b| / max |b|: 0 when bitwise equal.
inline double relative_error(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor fa = a.to(at::kDouble);
  const at::Tensor fb = b.to(at::kDouble);
  const double scale = fb.abs().max().item<double>();
  return (fa - fb).abs().max().item<double>() / (scale > 0 ? scale : 1.0);
}

// Per element: |actual - expected| <= rtol * (|expected| + rms(expected)), in fp64. The rms
// floor is what makes a per-element check meaningful in fp32: an element that is a sum of
// terms of the tensor's typical size, summed in another order (over ranks, or by another
// blocking of a matmul), carries rounding errors of that size even where the terms cancel to
// nearly zero. elements_beyond counts the elements outside the bound; expect_close_per_element
// fails naming the worst element (index, both values) and how many are outside.
inline at::Tensor excess_over(const at::Tensor& actual, const at::Tensor& expected, double rtol) {
  const at::Tensor a = actual.detach().to(at::kDouble).reshape({-1});
  const at::Tensor e = expected.detach().to(at::kDouble).reshape({-1});
  const double rms = e.numel() == 0 ? 0.0 : e.square().mean().sqrt().item<double>();
  return (a - e).abs() - rtol * (e.abs() + rms);
}
inline int64_t elements_beyond(const at::Tensor& actual, const at::Tensor& expected, double rtol) {
  return (excess_over(actual, expected, rtol) > 0).sum().item<int64_t>();
}
inline void expect_close_per_element(const at::Tensor& actual, const at::Tensor& expected,
                                     const std::string& what, double rtol = 1e-5) {
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  const at::Tensor excess = excess_over(actual, expected, rtol);
  const int64_t failing = (excess > 0).sum().item<int64_t>();
  if (failing == 0) return;
  const int64_t worst = excess.argmax().item<int64_t>();
  ADD_FAILURE() << what << ": " << failing << " of " << excess.numel() << " elements beyond "
                << rtol << " x (|expected| + rms); the worst, element " << worst << ": "
                << actual.detach().reshape({-1})[worst].item<double>() << " against "
                << expected.detach().reshape({-1})[worst].item<double>();
}

// Every parameter of `model` against the reference: bitwise when `rtol` is 0, else per element
// within rtol x (|expected| + rms(expected)) (expect_close_per_element).
inline void expect_parameters_match(Mlp& model, const std::map<std::string, at::Tensor>& expected,
                                    double rtol, const std::string& what) {
  for (const auto& item : model.named_parameters()) {
    const at::Tensor actual = item.value().detach();
    const at::Tensor& reference = expected.at(item.key());
    if (rtol == 0) {
      EXPECT_TRUE(actual.equal(reference))
          << what << ": " << item.key() << " differs from the reference (bitwise expected), "
          << "relative error " << relative_error(actual, reference);
    } else {
      expect_close_per_element(actual, reference, what + ": " + item.key(), rtol);
    }
  }
}

inline std::vector<Scenario> scenarios_for(ZeroStage stage) {
  std::vector<Scenario> out;
  out.push_back({.name = "adamw", .stage = stage});
  out.push_back({.name = "sgd-accumulate-clip",
                 .stage = stage,
                 .adamw = false,
                 .micro_steps = 2,
                 .clip = 0.05});
  out.push_back({.name = "adamw-clip", .stage = stage, .clip = 0.05});
  out.push_back({.name = "adamw-bf16-accumulate", .stage = stage, .micro_steps = 2, .bf16 = true});
  if (stage == ZeroStage::kNone) {
    out.push_back({.name = "torch-adamw", .stage = stage, .torch_optimizer = true});
  }
  return out;
}

// One rank's part of the equivalence check: every scenario of `stage`, against references
// computed on this rank.
inline void check_equivalence(comm::Group& group, ZeroStage stage) {
  const int world = group.size();
  for (const Scenario& s : scenarios_for(stage)) {
    const auto expected = reference_training(world, s);
    auto model = make_model(s.bf16 ? at::kBFloat16 : at::kFloat);
    if (group.rank() != 0) {  // the broadcast at construction must overwrite these
      torch::NoGradGuard no_grad;
      for (at::Tensor& p : model->parameters()) p.add_(1.0);
    }
    DataParallel dp(
        model, group,
        {.bucket_bytes = s.bucket_bytes, .zero_stage = stage, .timeout = std::chrono::seconds(60)});
    EXPECT_GT(dp.bucket_count(), 1);
    train_data_parallel(dp, *model, group.rank(), world, s);
    const auto init = initial_parameters();  // training moved the parameters (not vacuous)
    EXPECT_GT(relative_error(model->fc2->weight.detach(), init.at("fc2.weight")), 1e-3) << s.name;
    // Bitwise at W = 1 unless accumulation or clipping is on. Clipping: torch's norm is the
    // float norm of the per-parameter float norms; DataParallel's is the square root of a
    // double sum of per-bucket-slice float norms (the same at any bucket layout and world
    // size). The two norms differ in the last float bit (~1e-7 relative), and so does the
    // clipping coefficient; the 1e-6 tolerance covers that after three steps.
    const bool bitwise = world == 1 && s.micro_steps == 1 && s.clip == 0;
    expect_parameters_match(
        *model, expected, bitwise ? 0.0 : 1e-6,
        std::string(to_string(stage)) + "/" + s.name + " at W=" + std::to_string(world));
  }
}

// The (world size, stage) cases the thread and process tests run, and their names
// ("zero2_W3").
inline auto worlds_and_stages() {
  return ::testing::Combine(::testing::Values(1, 2, 3, 4),
                            ::testing::Values(ZeroStage::kNone, ZeroStage::kOne, ZeroStage::kTwo));
}
inline std::string world_and_stage_name(
    const ::testing::TestParamInfo<std::tuple<int, ZeroStage>>& info) {
  return std::string(to_string(std::get<1>(info.param))) + "_W" +
         std::to_string(std::get<0>(info.param));
}

// Corrupt 'optim' blobs, each with the cause a wrapper's load_state must quote: not JSON, the
// step missing (nlohmann's own words), a step that is a string or a fraction.
inline std::vector<std::pair<std::string, std::string>> corrupt_optim_blobs() {
  std::vector<std::pair<std::string, std::string>> cases;
  for (const std::string blob : {"{\"optimizer\": \"adamw\"", "{\"optimizer\": \"adamw\"}"}) {
    try {
      (void)nlohmann::json::parse(blob).at("step");
    } catch (const nlohmann::json::exception& e) {
      cases.emplace_back(blob, e.what());
    }
  }
  cases.emplace_back("{\"optimizer\": \"adamw\", \"step\": \"two\"}",
                     "\"step\" is \"two\", not an integer that fits 64 bits");
  cases.emplace_back("{\"optimizer\": \"adamw\", \"step\": 2.5}",
                     "\"step\" is 2.5, not an integer that fits 64 bits");
  return cases;
}

}  // namespace loom::testing::parallel
