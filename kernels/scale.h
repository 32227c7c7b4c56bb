// Scaling a contiguous buffer in place: turns a summed gradient into a mean after an
// all-reduce. CUDA kernels for fp32 and bf16; their CPU references are in scale_ref.h.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "scale_ref.h"

namespace loom::kernels {

// data[i] *= factor for i in [0, n), on `stream`. Returns the launch's CUDA error code.
cudaError_t scale_f32(float* data, int64_t n, float factor, cudaStream_t stream);
// bf16 stored as raw uint16 bits; the product is computed in fp32 and rounded to nearest even.
cudaError_t scale_bf16(uint16_t* data, int64_t n, float factor, cudaStream_t stream);

}  // namespace loom::kernels
