// AdamW and SGD on flat buffers, mirroring libtorch 1.13's torch/csrc/api/src/optim/adamw.cpp
// and sgd.cpp statement by statement (the same ATen calls with the same scalars), so results
// match torch::optim bit for bit on the same inputs.
#include "loom/parallel/optim.h"

#include <ATen/ATen.h>

#include <cmath>

#include "loom/error.h"

namespace loom::optim {

AdamW::AdamW(const AdamWOptions& options) : options_(options) {
  LOOM_CHECK(options.lr >= 0, InvalidArgument, "AdamW: lr must be >= 0, got ", options.lr);
  LOOM_CHECK(options.beta1 >= 0 && options.beta1 < 1 && options.beta2 >= 0 && options.beta2 < 1,
             InvalidArgument, "AdamW: betas must be in [0, 1), got ", options.beta1, ", ",
             options.beta2);
  LOOM_CHECK(options.eps >= 0, InvalidArgument, "AdamW: eps must be >= 0, got ", options.eps);
}

void AdamW::update(const at::Tensor& params, const at::Tensor& grads,
                   std::vector<at::Tensor>& state, int64_t step) const {
  at::Tensor p = params;  // a handle; the in-place ops below update the caller's storage
  if (options_.weight_decay != 0) p.mul_(1 - options_.lr * options_.weight_decay);
  at::Tensor& exp_avg = state.at(0);
  at::Tensor& exp_avg_sq = state.at(1);
  const double bias_correction1 = 1 - std::pow(options_.beta1, static_cast<double>(step));
  const double bias_correction2 = 1 - std::pow(options_.beta2, static_cast<double>(step));
  exp_avg.mul_(options_.beta1).add_(grads, 1 - options_.beta1);
  exp_avg_sq.mul_(options_.beta2).addcmul_(grads, grads, 1 - options_.beta2);
  const at::Tensor denom = (exp_avg_sq.sqrt() / std::sqrt(bias_correction2)).add_(options_.eps);
  const double step_size = options_.lr / bias_correction1;
  p.addcdiv_(exp_avg, denom, -step_size);
}

Sgd::Sgd(const SgdOptions& options) : options_(options) {
  LOOM_CHECK(options.lr >= 0, InvalidArgument, "SGD: lr must be >= 0, got ", options.lr);
  LOOM_CHECK(!options.nesterov || (options.momentum > 0 && options.dampening == 0), InvalidArgument,
             "SGD: Nesterov momentum needs momentum > 0 and dampening == 0");
}

std::vector<std::string> Sgd::state_names() const {
  if (options_.momentum == 0) return {};
  return {"momentum_buffer"};
}

void Sgd::update(const at::Tensor& params, const at::Tensor& grads, std::vector<at::Tensor>& state,
                 int64_t step) const {
  at::Tensor p = params;
  at::Tensor d_p = grads;
  if (options_.weight_decay != 0) d_p = d_p.add(p, options_.weight_decay);
  if (options_.momentum != 0) {
    at::Tensor& buf = state.at(0);
    if (step == 1) {
      buf.copy_(d_p);  // torch: buf = clone(d_p) on the first step
    } else {
      buf.mul_(options_.momentum).add_(d_p, 1 - options_.dampening);
    }
    d_p = options_.nesterov ? d_p.add(buf, options_.momentum) : buf;
  }
  p.add_(d_p, -1 * options_.lr);
}

}  // namespace loom::optim
