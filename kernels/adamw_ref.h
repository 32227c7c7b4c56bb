// The fused multi-tensor AdamW step: its scalars, its tensors and its CPU reference. The
// CUDA kernel (adamw.h) and the reference compute the same float operations in the same order,
// which are the ones Loom's flat AdamW (src/optim/flat_optimizer.cpp) runs through ATen on the CPU,
// so all three agree bit for bit (ATen's AVX2/AVX-512 kernels fuse `a + alpha * b` and
// `a + s * b * c` into one fused multiply-add; the reference and the kernel fuse the same two).
// Compiled in every build; no CUDA header.
#pragma once

#include <cstdint>

namespace loom::kernels {

// One step's scalars, each computed in double and rounded to float once, as ATen rounds a
// double Scalar for a float tensor.
struct AdamWScalars {
  bool decay = false;               // weight_decay != 0: params *= decay_factor first
  float decay_factor = 1;           // 1 - lr * weight_decay
  float beta1 = 0.9f;               // exp_avg *= beta1
  float one_minus_beta1 = 0.1f;     // then exp_avg += (1 - beta1) * grad
  float beta2 = 0.999f;             // exp_avg_sq *= beta2
  float one_minus_beta2 = 0.001f;   // then exp_avg_sq += (1 - beta2) * grad * grad
  float sqrt_bias_correction2 = 1;  // sqrt(1 - beta2^step)
  float eps = 1e-8f;                // denom = sqrt(exp_avg_sq) / sqrt_bias_correction2 + eps
  float neg_step_size = 0;          // -lr / (1 - beta1^step): params += neg_step * m / denom
};

// The scalars of step `step` (from 1) for these hyperparameters, as flat_optimizer.cpp derives
// them.
AdamWScalars adamw_scalars(double lr, double beta1, double beta2, double eps, double weight_decay,
                           int64_t step);

// One flat buffer of the multi-tensor update, all of n elements. bf16_params, when not null,
// receives the updated params rounded to bf16 (nearest even) in the same pass.
struct AdamWTensor {
  float* params = nullptr;
  const float* grads = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  uint16_t* bf16_params = nullptr;
  int64_t n = 0;
};

// One AdamW step over `count` tensors, in place.
void adamw_ref(const AdamWScalars& scalars, const AdamWTensor* tensors, int count);

}  // namespace loom::kernels
