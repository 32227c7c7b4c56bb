// The scale kernels against their CPU references, bitwise. Needs a GPU; skipped without one.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "scale.h"

namespace loom::kernels {
namespace {

bool have_gpu() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

template <typename T>
std::vector<T> run_on_gpu(std::vector<T> host,
                          cudaError_t (*kernel)(T*, int64_t, float, cudaStream_t), float factor) {
  T* device = nullptr;
  EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&device), host.size() * sizeof(T) + 1),
            cudaSuccess);
  EXPECT_EQ(cudaMemcpy(device, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
            cudaSuccess);
  EXPECT_EQ(kernel(device, static_cast<int64_t>(host.size()), factor, nullptr), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(host.data(), device, host.size() * sizeof(T), cudaMemcpyDeviceToHost),
            cudaSuccess);
  cudaFree(device);
  return host;
}

TEST(ScaleKernel, F32MatchesReferenceBitwise) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  for (int64_t n : {0, 1, 255, 256, 257, 1 << 20}) {
    std::vector<float> data(static_cast<size_t>(n));
    std::mt19937 gen(7);
    std::normal_distribution<float> dist;
    for (auto& x : data) x = dist(gen);
    std::vector<float> expected = data;
    scale_f32_ref(expected.data(), n, 0.25f);
    std::vector<float> got = run_on_gpu(data, scale_f32, 0.25f);
    EXPECT_EQ(0, std::memcmp(got.data(), expected.data(), got.size() * sizeof(float))) << n;
  }
}

TEST(ScaleKernel, Bf16MatchesReferenceBitwise) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  std::vector<uint16_t> data(100003);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint16_t>(i * 2654435761u >> 16);
  std::vector<uint16_t> expected = data;
  scale_bf16_ref(expected.data(), static_cast<int64_t>(expected.size()), 1.0f / 3.0f);
  std::vector<uint16_t> got = run_on_gpu(data, scale_bf16, 1.0f / 3.0f);
  for (size_t i = 0; i < got.size(); ++i) {
    bool both_nan = (expected[i] & 0x7fff) > 0x7f80 && (got[i] & 0x7fff) > 0x7f80;
    if (!both_nan) {
      ASSERT_EQ(got[i], expected[i]) << "element " << i;
    }
  }
}

}  // namespace
}  // namespace loom::kernels
