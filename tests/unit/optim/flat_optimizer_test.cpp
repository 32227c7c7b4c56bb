// Loom's flat AdamW and SGD against torch::optim::AdamW / SGD on the same tensors: bitwise.

#include "loom/optim/flat_optimizer.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "loom/error.h"
#include "optim/sum_of_squares.h"

namespace loom::optim {
namespace {

// Steps one tensor with torch and the same values, flattened, with `flat`; compares bitwise.
void expect_same_as_torch(torch::optim::Optimizer& reference, at::Tensor& param,
                          const FlatOptimizer& flat, int steps) {
  at::Tensor mine = param.detach().clone().reshape(-1);
  std::vector<at::Tensor> state;
  for (size_t i = 0; i < flat.state_names().size(); ++i) state.push_back(at::zeros_like(mine));
  for (int step = 1; step <= steps; ++step) {
    const at::Tensor grad =
        at::sin(at::arange(param.numel(), at::kFloat) * step + 0.5).reshape(param.sizes());
    param.mutable_grad() = grad.clone();
    reference.step();
    flat.update(mine, grad.reshape(-1), state, step);
    ASSERT_TRUE(mine.equal(param.detach().reshape(-1))) << "step " << step;
  }
}

TEST(FlatOptimizer, AdamWMatchesTorchBitwise) {
  for (double weight_decay : {0.0, 0.1}) {
    at::Tensor param = at::randn({37, 5}).requires_grad_(true);
    torch::optim::AdamW reference(
        {param},
        torch::optim::AdamWOptions(0.01).betas({0.8, 0.99}).eps(1e-7).weight_decay(weight_decay));
    AdamW flat(
        {.lr = 0.01, .beta1 = 0.8, .beta2 = 0.99, .eps = 1e-7, .weight_decay = weight_decay});
    expect_same_as_torch(reference, param, flat, 5);
  }
}

TEST(FlatOptimizer, SgdVariantsMatchTorchBitwise) {
  struct Case {
    double momentum, dampening, weight_decay;
    bool nesterov;
  };
  for (const Case& c : {Case{0, 0, 0, false}, Case{0.9, 0, 1e-3, false}, Case{0.9, 0.1, 0, false},
                        Case{0.9, 0, 1e-2, true}}) {
    at::Tensor param = at::randn({41}).requires_grad_(true);
    torch::optim::SGD reference({param}, torch::optim::SGDOptions(0.05)
                                             .momentum(c.momentum)
                                             .dampening(c.dampening)
                                             .weight_decay(c.weight_decay)
                                             .nesterov(c.nesterov));
    Sgd flat({.lr = 0.05,
              .momentum = c.momentum,
              .dampening = c.dampening,
              .weight_decay = c.weight_decay,
              .nesterov = c.nesterov});
    expect_same_as_torch(reference, param, flat, 4);
  }
}

TEST(FlatOptimizer, BadOptionsAreRejected) {
  EXPECT_THROW(AdamW({.lr = -1}), InvalidArgument);
  EXPECT_THROW(AdamW({.beta1 = 1.0}), InvalidArgument);
  EXPECT_THROW(Sgd({.nesterov = true}), InvalidArgument);
}

TEST(FlatOptimizer, AdamWBf16CopyIsTheUpdateRoundedToNearestEven) {
  const AdamW adamw({.lr = 1e-2});
  at::Tensor plain = at::randn({1000});
  at::Tensor with_copy = plain.clone();
  std::vector<at::Tensor> s1 = {at::zeros({1000}), at::zeros({1000})};
  std::vector<at::Tensor> s2 = {at::zeros({1000}), at::zeros({1000})};
  at::Tensor bf16 = at::empty({1000}, at::kBFloat16);
  const at::Tensor grad = at::randn({1000});
  adamw.update(plain, grad, s1, 1);
  adamw.update_with_bf16_copy(with_copy, grad, s2, 1, bf16);
  EXPECT_TRUE(with_copy.equal(plain));
  EXPECT_TRUE(s2[0].equal(s1[0]) && s2[1].equal(s1[1]));
  EXPECT_TRUE(bf16.equal(plain.to(at::kBFloat16)));
  std::vector<at::Tensor> short_state = {at::zeros({1000})};
  EXPECT_THROW(adamw.update(plain, grad, short_state, 2), InvalidArgument);
}

// The CPU path is the arithmetic DataParallel's clipping has used: a float 2-norm per tensor,
// squared and summed in double.
TEST(SumOfSquares, CpuIsFloatNormsSquaredAndSummedInDouble) {
  const std::vector<at::Tensor> tensors = {at::randn({1000}), at::randn({7}) * 10, at::empty({0})};
  double expected = 0;
  for (const at::Tensor& t : tensors) {
    const double n = at::linalg_vector_norm(t, 2, c10::nullopt, false, at::kFloat).item<double>();
    expected += n * n;
  }
  const at::Tensor got = internal::sum_of_squares(tensors);
  EXPECT_EQ(got.scalar_type(), at::kDouble);
  EXPECT_TRUE(got.device().is_cpu());
  ASSERT_EQ(got.numel(), 1);
  EXPECT_EQ(got.item<double>(), expected);
  EXPECT_EQ(internal::sum_of_squares({}).item<double>(), 0.0);
}

}  // namespace
}  // namespace loom::optim
