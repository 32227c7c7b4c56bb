// CPU reference of the multi-tensor sum of squares (sum_squares_ref.h): the kernel's order of
// double additions, thread by thread and tree level by tree level.
#include "sum_squares_ref.h"

#include <cstddef>
#include <vector>

namespace loom::kernels {
namespace {

// The block's shared-memory tree: sums[t] += sums[t + stride] for halving strides.
double tree_sum(std::vector<double>& sums) {
  for (int stride = kSumSquaresThreads / 2; stride > 0; stride /= 2) {
    for (int t = 0; t < stride; ++t) sums[t] = sums[t] + sums[t + stride];
  }
  return sums[0];
}

}  // namespace

int64_t sum_squares_chunks(const SquaresTensor* tensors, int count) {
  int64_t chunks = 0;
  for (int t = 0; t < count; ++t)
    chunks += (tensors[t].n + kSumSquaresChunk - 1) / kSumSquaresChunk;
  return chunks;
}

double sum_squares_ref(const SquaresTensor* tensors, int count) {
  std::vector<double> partials;
  std::vector<double> sums(kSumSquaresThreads);
  for (int t = 0; t < count; ++t) {
    for (int64_t begin = 0; begin < tensors[t].n; begin += kSumSquaresChunk) {
      const int64_t end =
          begin + kSumSquaresChunk < tensors[t].n ? begin + kSumSquaresChunk : tensors[t].n;
      for (int thread = 0; thread < kSumSquaresThreads; ++thread) {
        double acc = 0;
        for (int64_t i = begin + thread; i < end; i += kSumSquaresThreads) {
          const double x = tensors[t].data[i];
          acc = acc + x * x;  // x * x is exact in double
        }
        sums[thread] = acc;
      }
      partials.push_back(tree_sum(sums));
    }
  }
  // The final block: thread t adds partials t, t + kThreads, ...; then the tree.
  for (int thread = 0; thread < kSumSquaresThreads; ++thread) {
    double acc = 0;
    for (size_t i = static_cast<size_t>(thread); i < partials.size(); i += kSumSquaresThreads) {
      acc = acc + partials[i];
    }
    sums[thread] = acc;
  }
  return tree_sum(sums);
}

}  // namespace loom::kernels
