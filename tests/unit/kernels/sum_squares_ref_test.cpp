// The multi-tensor sum of squares reference (kernels/sum_squares_ref.h): exact where the sum is
// exact, within double rounding of libtorch's sum otherwise, and its chunk count. The GPU
// kernel is checked against it bit for bit in tests/gpu/sum_squares_test.cpp.
#include "sum_squares_ref.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

namespace loom::kernels {
namespace {

std::vector<SquaresTensor> views(const std::vector<at::Tensor>& tensors) {
  std::vector<SquaresTensor> out;
  for (const at::Tensor& t : tensors) out.push_back({t.data_ptr<float>(), t.numel()});
  return out;
}

TEST(SumSquaresRef, SmallIntegersSumExactly) {
  // Every partial sum is an integer below 2^53, so any order gives the exact value.
  std::vector<at::Tensor> tensors = {at::arange(0, 1000, at::kFloat),
                                     at::full({kSumSquaresChunk + 5}, 3.0f), at::empty({0}),
                                     at::full({1}, -2.0f)};
  double exact = 0;
  for (int64_t i = 0; i < 1000; ++i) exact += static_cast<double>(i) * i;
  exact += 9.0 * (kSumSquaresChunk + 5) + 4.0;
  const auto v = views(tensors);
  EXPECT_EQ(sum_squares_ref(v.data(), static_cast<int>(v.size())), exact);
  EXPECT_EQ(sum_squares_chunks(v.data(), static_cast<int>(v.size())), 1 + 2 + 0 + 1);
}

TEST(SumSquaresRef, AgreesWithLibtorchInDoubleWithinRounding) {
  at::manual_seed(3);
  std::vector<at::Tensor> tensors = {at::randn({300000}), at::randn({17}) * 1e3,
                                     at::randn({kSumSquaresChunk})};
  double expected = 0;
  for (const at::Tensor& t : tensors) expected += t.to(at::kDouble).square().sum().item<double>();
  const auto v = views(tensors);
  const double got = sum_squares_ref(v.data(), static_cast<int>(v.size()));
  // ~3.6e5 double additions: relative error well under 1e-12.
  EXPECT_NEAR(got, expected, std::abs(expected) * 1e-12);
}

TEST(SumSquaresRef, NoTensorsOrOnlyEmptyOnesIsZero) {
  EXPECT_EQ(sum_squares_ref(nullptr, 0), 0.0);
  at::Tensor empty = at::empty({0});
  const auto v = views({empty});
  EXPECT_EQ(sum_squares_ref(v.data(), 1), 0.0);
  EXPECT_EQ(sum_squares_chunks(v.data(), 1), 0);
}

}  // namespace
}  // namespace loom::kernels
