// The scale references (kernels/scale_ref.h) against libtorch's own fp32 and bf16 products.
#include "scale_ref.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstring>

namespace loom::kernels {
namespace {

TEST(ScaleRef, F32IsLibtorchsProduct) {
  at::Tensor x = at::randn({1001});
  const at::Tensor expected = x * 0.37f;
  scale_f32_ref(x.data_ptr<float>(), x.numel(), 0.37f);
  EXPECT_EQ(0, std::memcmp(x.data_ptr(), expected.data_ptr(), x.numel() * sizeof(float)));
}

TEST(ScaleRef, Bf16IsTheFp32ProductRoundedToNearestEven) {
  at::Tensor x = (at::randn({1001}) * 10).to(at::kBFloat16);
  const at::Tensor expected = (x.to(at::kFloat) * (1.0f / 3.0f)).to(at::kBFloat16);
  scale_bf16_ref(static_cast<uint16_t*>(x.data_ptr()), x.numel(), 1.0f / 3.0f);
  EXPECT_EQ(0, std::memcmp(x.data_ptr(), expected.data_ptr(), x.numel() * 2));
}

}  // namespace
}  // namespace loom::kernels
