// The multi-tensor sum of squares kernel against its CPU reference, bitwise (same order of
// double additions). Skipped without a GPU.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "sum_squares.h"

namespace loom::kernels {
namespace {

bool have_gpu() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

TEST(SumSquaresKernel, MatchesReferenceBitwise) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  // 80 tensors (more than one launch's descriptors), one of 30M (more than one launch's blocks).
  std::vector<int64_t> sizes = {0, 1, 255, 256, 257, 65536, 65537, 30'000'000};
  for (int i = 0; i < 72; ++i) sizes.push_back(3000 + 101 * i);
  std::mt19937 gen(5);
  std::normal_distribution<float> normal;
  std::vector<std::vector<float>> hosts;
  std::vector<SquaresTensor> ref;
  std::vector<SquaresTensor> dev;
  for (int64_t n : sizes) {
    hosts.emplace_back(static_cast<size_t>(n));
    for (float& x : hosts.back()) x = normal(gen);
    float* d = nullptr;
    ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&d), n * sizeof(float) + 4), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(d, hosts.back().data(), n * sizeof(float), cudaMemcpyHostToDevice),
              cudaSuccess);
    ref.push_back({hosts.back().data(), n});
    dev.push_back({d, n});
  }
  const int count = static_cast<int>(sizes.size());
  const int64_t chunks = sum_squares_chunks(ref.data(), count);
  double* workspace = nullptr;
  double* out = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&workspace), chunks * sizeof(double)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&out), sizeof(double)), cudaSuccess);
  ASSERT_EQ(sum_squares(dev.data(), count, workspace, out, nullptr), cudaSuccess);
  double got = 0;
  ASSERT_EQ(cudaMemcpy(&got, out, sizeof(double), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(got, sum_squares_ref(ref.data(), count));
  for (auto& d : dev) cudaFree(const_cast<float*>(d.data));
  cudaFree(workspace);
  cudaFree(out);
}

}  // namespace
}  // namespace loom::kernels
