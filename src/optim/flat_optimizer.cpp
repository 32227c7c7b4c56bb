// AdamW and SGD on flat buffers, mirroring libtorch 1.13's torch/csrc/api/src/optim/adamw.cpp
// and sgd.cpp statement by statement (the same ATen calls with the same scalars), so results
// match torch::optim bit for bit on the same inputs. On CUDA tensors AdamW runs the fused kernel
// (kernels/adamw.cu, through optim/device_kernels.h), which computes the same float
// operations as the CPU path.
#include "loom/optim/flat_optimizer.h"

#include <ATen/ATen.h>

#include <cmath>

#include "loom/error.h"
#include "optim/device_kernels.h"
#include "optim/sum_of_squares.h"

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
  update_with_bf16_copy(params, grads, state, step, at::Tensor());
}

void AdamW::update_with_bf16_copy(const at::Tensor& params, const at::Tensor& grads,
                                  std::vector<at::Tensor>& state, int64_t step,
                                  const at::Tensor& bf16_params) const {
  LOOM_CHECK(state.size() == 2, InvalidArgument,
             "AdamW: state needs 2 tensors (exp_avg, "
             "exp_avg_sq), got ",
             state.size());
  if (params.is_cuda()) {
    internal::fused_adamw(
        {options_.lr, options_.beta1, options_.beta2, options_.eps, options_.weight_decay, step},
        params, grads, state[0], state[1], bf16_params);
    return;
  }
  update_on_cpu(params, grads, state, step);
  if (bf16_params.defined()) bf16_params.copy_(params);
}

void AdamW::update_on_cpu(const at::Tensor& params, const at::Tensor& grads,
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

namespace internal {

at::Tensor sum_of_squares(const std::vector<at::Tensor>& tensors) {
  bool fused = !tensors.empty();
  for (const at::Tensor& t : tensors) {
    fused = fused && t.is_cuda() && t.scalar_type() == at::kFloat && t.is_contiguous() &&
            t.device() == tensors[0].device();
  }
  if (fused) return fused_sum_of_squares(tensors);
  // A float norm per tensor (no double copy), squared and summed in double.
  if (!tensors.empty() && !tensors[0].is_cpu()) {
    at::Tensor total = at::zeros({1}, tensors[0].options().dtype(at::kDouble));
    for (const at::Tensor& t : tensors) {
      total.add_(
          at::linalg_vector_norm(t, 2, c10::nullopt, false, at::kFloat).to(at::kDouble).square());
    }
    return total;
  }
  double local = 0;
  for (const at::Tensor& t : tensors) {
    const double n = at::linalg_vector_norm(t, 2, c10::nullopt, false, at::kFloat).item<double>();
    local += n * n;
  }
  return at::full({1}, local, at::kDouble);
}

}  // namespace internal
}  // namespace loom::optim
