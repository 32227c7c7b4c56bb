// CUDA kernel for adamw.h. Each block updates one chunk of one tensor; a launch carries up to
// kMaxTensors tensor descriptors and kMaxBlocks (tensor, chunk) pairs in its parameters (under
// the 4 KiB parameter limit). Every float operation is an explicit round-to-nearest intrinsic,
// so nvcc cannot contract them differently from the reference.
#include <cuda_bf16.h>

#include "adamw.h"

namespace loom::kernels {
namespace {

constexpr int kThreads = 512;
constexpr int64_t kChunk = 65536;
constexpr int kMaxTensors = 24;
constexpr int kMaxBlocks = 320;

struct AdamWBatch {
  AdamWTensor tensors[kMaxTensors];
  int block_tensor[kMaxBlocks];  // which of `tensors` block b updates
  int block_chunk[kMaxBlocks];   // and which chunk of it
};
static_assert(sizeof(AdamWBatch) + sizeof(AdamWScalars) < 4000, "kernel parameters over 4 KiB");

__global__ void __launch_bounds__(kThreads) adamw_kernel(AdamWScalars s, AdamWBatch batch) {
  const AdamWTensor& x = batch.tensors[batch.block_tensor[blockIdx.x]];
  const int64_t begin = int64_t{batch.block_chunk[blockIdx.x]} * kChunk;
  const int64_t end = begin + kChunk < x.n ? begin + kChunk : x.n;
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    float p = x.params[i];
    const float g = x.grads[i];
    if (s.decay) p = __fmul_rn(p, s.decay_factor);
    const float m = __fmaf_rn(s.one_minus_beta1, g, __fmul_rn(x.exp_avg[i], s.beta1));
    const float v =
        __fmaf_rn(__fmul_rn(s.one_minus_beta2, g), g, __fmul_rn(x.exp_avg_sq[i], s.beta2));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), s.sqrt_bias_correction2), s.eps);
    p = __fadd_rn(p, __fdiv_rn(__fmul_rn(s.neg_step_size, m), denom));
    x.exp_avg[i] = m;
    x.exp_avg_sq[i] = v;
    x.params[i] = p;
    if (x.bf16_params != nullptr) {
      reinterpret_cast<__nv_bfloat16*>(x.bf16_params)[i] = __float2bfloat16_rn(p);
    }
  }
}

}  // namespace

cudaError_t adamw(const AdamWScalars& scalars, const AdamWTensor* tensors, int count,
                  cudaStream_t stream) {
  AdamWBatch batch{};
  int used_tensors = 0;
  int used_blocks = 0;
  auto flush = [&]() -> cudaError_t {
    cudaError_t error = cudaSuccess;
    if (used_blocks > 0) {
      adamw_kernel<<<used_blocks, kThreads, 0, stream>>>(scalars, batch);
      error = cudaGetLastError();
    }
    used_tensors = 0;
    used_blocks = 0;
    return error;
  };
  for (int t = 0; t < count; ++t) {
    if (tensors[t].n <= 0) continue;
    if (used_tensors == kMaxTensors) {
      if (cudaError_t error = flush(); error != cudaSuccess) return error;
    }
    int slot = used_tensors++;
    batch.tensors[slot] = tensors[t];
    const int64_t chunks = (tensors[t].n + kChunk - 1) / kChunk;
    for (int64_t c = 0; c < chunks; ++c) {
      if (used_blocks == kMaxBlocks) {
        if (cudaError_t error = flush(); error != cudaSuccess) return error;
        slot = used_tensors++;  // the tensor continues in the next launch, in slot 0
        batch.tensors[slot] = tensors[t];
      }
      batch.block_tensor[used_blocks] = slot;
      batch.block_chunk[used_blocks] = static_cast<int>(c);
      ++used_blocks;
    }
  }
  return flush();
}

}  // namespace loom::kernels
