// CUDA kernels for scale.h: a grid-stride loop, one element per thread per iteration.
#include "scale.h"

#include <cuda_bf16.h>

namespace loom::kernels {
namespace {

constexpr int kThreads = 256;

int blocks_for(int64_t n) {
  int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < 65535 ? (blocks > 0 ? blocks : 1) : 65535);
}

__global__ void scale_f32_kernel(float* data, int64_t n, float factor) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{blockDim.x} * gridDim.x) {
    data[i] *= factor;
  }
}

__global__ void scale_bf16_kernel(__nv_bfloat16* data, int64_t n, float factor) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{blockDim.x} * gridDim.x) {
    data[i] = __float2bfloat16_rn(__bfloat162float(data[i]) * factor);
  }
}

}  // namespace

cudaError_t scale_f32(float* data, int64_t n, float factor, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  scale_f32_kernel<<<blocks_for(n), kThreads, 0, stream>>>(data, n, factor);
  return cudaGetLastError();
}

cudaError_t scale_bf16(uint16_t* data, int64_t n, float factor, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  scale_bf16_kernel<<<blocks_for(n), kThreads, 0, stream>>>(reinterpret_cast<__nv_bfloat16*>(data),
                                                            n, factor);
  return cudaGetLastError();
}

}  // namespace loom::kernels
