// The multi-tensor sum of squares on the GPU (the global gradient norm before its square root):
// the order of sum_squares_ref.h, so the double equals the reference's bit for bit.
#pragma once

#include <cuda_runtime_api.h>

#include "sum_squares_ref.h"

namespace loom::kernels {

// *out (device memory, one double) = the sum of squares of `count` fp32 tensors in device
// memory, on `stream`. `workspace` is device memory for max(1, sum_squares_chunks(...))
// doubles. Returns the first launch's CUDA error code.
cudaError_t sum_squares(const SquaresTensor* tensors, int count, double* workspace, double* out,
                        cudaStream_t stream);

}  // namespace loom::kernels
