// The fused multi-tensor AdamW step on the GPU: one pass over every flat buffer updates params,
// exp_avg and exp_avg_sq (and writes the bf16 copy of params when asked), the same arithmetic as
// adamw_ref.h, bit for bit.
#pragma once

#include <cuda_runtime_api.h>

#include "adamw_ref.h"

namespace loom::kernels {

// One step over `count` tensors whose pointers are device memory, on `stream`. Tensors may be of
// any size (empty ones are skipped); they are packed into as few launches as fit the kernel's
// parameter space. Returns the first launch's CUDA error code.
cudaError_t adamw(const AdamWScalars& scalars, const AdamWTensor* tensors, int count,
                  cudaStream_t stream);

}  // namespace loom::kernels
