// CPU reference of the fused AdamW step (adamw_ref.h). Built with -ffp-contract=off: the only
// fused multiply-adds are the two std::fma calls, where ATen's vectorised kernels fuse.
#include "adamw_ref.h"

#include <cmath>

#include "scale_ref.h"

namespace loom::kernels {

AdamWScalars adamw_scalars(double lr, double beta1, double beta2, double eps, double weight_decay,
                           int64_t step) {
  // The same expressions as src/optim/flat_optimizer.cpp (and torch::optim::AdamW 1.13).
  const double bias_correction1 = 1 - std::pow(beta1, static_cast<double>(step));
  const double bias_correction2 = 1 - std::pow(beta2, static_cast<double>(step));
  const double step_size = lr / bias_correction1;
  AdamWScalars s;
  s.decay = weight_decay != 0;
  s.decay_factor = static_cast<float>(1 - lr * weight_decay);
  s.beta1 = static_cast<float>(beta1);
  s.one_minus_beta1 = static_cast<float>(1 - beta1);
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta2 = static_cast<float>(1 - beta2);
  s.sqrt_bias_correction2 = static_cast<float>(std::sqrt(bias_correction2));
  s.eps = static_cast<float>(eps);
  s.neg_step_size = static_cast<float>(-step_size);
  return s;
}

void adamw_ref(const AdamWScalars& s, const AdamWTensor* tensors, int count) {
  for (int t = 0; t < count; ++t) {
    const AdamWTensor& x = tensors[t];
    for (int64_t i = 0; i < x.n; ++i) {
      float p = x.params[i];
      const float g = x.grads[i];
      if (s.decay) p = p * s.decay_factor;  // p.mul_(1 - lr * wd)
      const float m = std::fma(s.one_minus_beta1, g, x.exp_avg[i] * s.beta1);         // mul_, add_
      const float v = std::fma(s.one_minus_beta2 * g, g, x.exp_avg_sq[i] * s.beta2);  // addcmul_
      const float denom = std::sqrt(v) / s.sqrt_bias_correction2 + s.eps;
      p = p + (s.neg_step_size * m) / denom;  // addcdiv_
      x.exp_avg[i] = m;
      x.exp_avg_sq[i] = v;
      x.params[i] = p;
      if (x.bf16_params != nullptr) x.bf16_params[i] = float_to_bf16(p);
    }
  }
}

}  // namespace loom::kernels
