// The fused CUDA kernels of kernels/ (AdamW, sum of squares) on CUDA tensors, for
// flat_optimizer.cpp. CUDA builds compile device_kernels_cuda.cpp; others device_kernels_none.cpp,
// whose functions throw (such a build has no CUDA tensors, so flat_optimizer.cpp never calls them
// there). Both run on torch's current CUDA stream of the tensors' device and never synchronise the
// host.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace loom::optim::internal {

// AdamW's hyperparameters and the step number (from 1).
struct AdamWStep {
  double lr = 0;
  double beta1 = 0;
  double beta2 = 0;
  double eps = 0;
  double weight_decay = 0;
  int64_t step = 1;
};

// One fused AdamW step over flat fp32 contiguous CUDA buffers of one size on one device, in
// place; bf16_params, when defined, is a bf16 buffer of that size that receives the updated
// params. Throws InvalidArgument naming the buffer that does not fit.
void fused_adamw(const AdamWStep& step, const at::Tensor& params, const at::Tensor& grads,
                 const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                 const at::Tensor& bf16_params);

// The sum of the squares of every element of `tensors` (fp32, contiguous, CUDA, one device;
// at least one) as a one-element float64 tensor on that device.
at::Tensor fused_sum_of_squares(const std::vector<at::Tensor>& tensors);

}  // namespace loom::optim::internal
