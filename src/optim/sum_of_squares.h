// The sum of squares of many tensors (the squared global gradient norm before the all-reduce),
// private to Loom (defined in flat_optimizer.cpp). The wrappers' gradient clipping calls it per
// rank.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace loom::optim::internal {

// A one-element float64 tensor on the tensors' device. CPU (or mixed/other dtypes): the sum over
// tensors of (float 2-norm of the tensor)^2 in double, the arithmetic DataParallel's clipping
// has always used. CUDA fp32 contiguous tensors: the fused kernel (kernels/sum_squares.h), one
// pass and no host synchronisation; equal to the CPU value within rounding (not bitwise:
// the summation orders differ). An empty list gives 0 on the CPU.
at::Tensor sum_of_squares(const std::vector<at::Tensor>& tensors);

}  // namespace loom::optim::internal
