// The multi-tensor sum of squares (for the global gradient norm): its launch geometry and its CPU
// reference. The CUDA kernel (sum_squares.h) splits every tensor into chunks of kChunk
// elements, gives each chunk to one block of kThreads threads (thread t sums elements t,
// t + kThreads, ... of the chunk in double, then the block adds the threads' sums as a tree),
// and one final block adds the chunks' sums the same way. The reference follows that order, so
// both give the same double bit for bit. Compiled in every build; no CUDA header.
#pragma once

#include <cstdint>

namespace loom::kernels {

inline constexpr int kSumSquaresThreads = 256;
inline constexpr int64_t kSumSquaresChunk = 65536;

// One fp32 tensor of n elements.
struct SquaresTensor {
  const float* data = nullptr;
  int64_t n = 0;
};

// How many chunks (partial sums) the kernel needs for these tensors: its workspace size.
int64_t sum_squares_chunks(const SquaresTensor* tensors, int count);

// sum over every element x of every tensor of double(x) * double(x), in the kernel's order.
double sum_squares_ref(const SquaresTensor* tensors, int count);

}  // namespace loom::kernels
