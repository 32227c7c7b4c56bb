// Loom's flat AdamW and SGD against torch::optim::AdamW / SGD on the same tensors: bitwise.

#include "loom/parallel/optim.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "loom/error.h"

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

}  // namespace
}  // namespace loom::optim
