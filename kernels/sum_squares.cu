// CUDA kernels for sum_squares.h: one block per chunk writes its partial sum to the workspace
// (tensor-major chunk order, as the reference), then one block adds the partials. Double
// arithmetic through explicit round-to-nearest intrinsics, in the reference's order.
#include "sum_squares.h"

namespace loom::kernels {
namespace {

constexpr int kThreads = kSumSquaresThreads;
constexpr int kMaxTensors = 64;
constexpr int kMaxBlocks = 320;

struct SquaresBatch {
  SquaresTensor tensors[kMaxTensors];
  int block_tensor[kMaxBlocks];
  int block_chunk[kMaxBlocks];
  int64_t first_partial;  // the workspace index of block 0's partial sum
};
static_assert(sizeof(SquaresBatch) < 4000, "kernel parameters over 4 KiB");

// sums[0] = the tree sum of sums[0..kThreads), as sum_squares_ref.cpp's tree_sum.
__device__ double block_tree_sum(double* sums) {
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    __syncthreads();
    if (threadIdx.x < stride)
      sums[threadIdx.x] = __dadd_rn(sums[threadIdx.x], sums[threadIdx.x + stride]);
  }
  __syncthreads();
  return sums[0];
}

__global__ void __launch_bounds__(kThreads) chunk_kernel(SquaresBatch batch, double* partials) {
  __shared__ double sums[kThreads];
  const SquaresTensor& x = batch.tensors[batch.block_tensor[blockIdx.x]];
  const int64_t begin = int64_t{batch.block_chunk[blockIdx.x]} * kSumSquaresChunk;
  const int64_t end = begin + kSumSquaresChunk < x.n ? begin + kSumSquaresChunk : x.n;
  double acc = 0;
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    const double v = x.data[i];
    acc = __dadd_rn(acc, __dmul_rn(v, v));
  }
  sums[threadIdx.x] = acc;
  const double total = block_tree_sum(sums);
  if (threadIdx.x == 0) partials[batch.first_partial + blockIdx.x] = total;
}

__global__ void __launch_bounds__(kThreads)
    final_kernel(const double* partials, int64_t count, double* out) {
  __shared__ double sums[kThreads];
  double acc = 0;
  for (int64_t i = threadIdx.x; i < count; i += kThreads) acc = __dadd_rn(acc, partials[i]);
  sums[threadIdx.x] = acc;
  const double total = block_tree_sum(sums);
  if (threadIdx.x == 0) *out = total;
}

}  // namespace

cudaError_t sum_squares(const SquaresTensor* tensors, int count, double* workspace, double* out,
                        cudaStream_t stream) {
  SquaresBatch batch{};
  int used_tensors = 0;
  int used_blocks = 0;
  int64_t partials = 0;
  auto flush = [&]() -> cudaError_t {
    cudaError_t error = cudaSuccess;
    if (used_blocks > 0) {
      batch.first_partial = partials;
      chunk_kernel<<<used_blocks, kThreads, 0, stream>>>(batch, workspace);
      error = cudaGetLastError();
      partials += used_blocks;
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
    const int64_t chunks = (tensors[t].n + kSumSquaresChunk - 1) / kSumSquaresChunk;
    for (int64_t c = 0; c < chunks; ++c) {
      if (used_blocks == kMaxBlocks) {
        if (cudaError_t error = flush(); error != cudaSuccess) return error;
        slot = used_tensors++;
        batch.tensors[slot] = tensors[t];
      }
      batch.block_tensor[used_blocks] = slot;
      batch.block_chunk[used_blocks] = static_cast<int>(c);
      ++used_blocks;
    }
  }
  if (cudaError_t error = flush(); error != cudaSuccess) return error;
  final_kernel<<<1, kThreads, 0, stream>>>(workspace, partials, out);
  return cudaGetLastError();
}

}  // namespace loom::kernels
