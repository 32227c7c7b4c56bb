// Scaling a contiguous buffer in place: turns a summed gradient into a mean after an
// all-reduce. CUDA kernels for fp32 and bf16, each with the CPU reference it is tested against.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace loom::kernels {

// data[i] *= factor for i in [0, n), on `stream`. Returns the launch's CUDA error code.
cudaError_t scale_f32(float* data, int64_t n, float factor, cudaStream_t stream);
// bf16 stored as raw uint16 bits; the product is computed in fp32 and rounded to nearest even.
cudaError_t scale_bf16(uint16_t* data, int64_t n, float factor, cudaStream_t stream);

// CPU references with the same rounding.
void scale_f32_ref(float* data, int64_t n, float factor);
void scale_bf16_ref(uint16_t* data, int64_t n, float factor);

}  // namespace loom::kernels
