// Loom's flat AdamW and sum of squares on CUDA tensors (the fused kernels through
// src/optim/device_kernels) against the same calls on the CPU. Skipped where libtorch has no
// CUDA or no GPU is visible.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "loom/optim/flat_optimizer.h"
#include "optim/sum_of_squares.h"

namespace loom::optim {
namespace {

TEST(CudaAdamW, StepsEqualTheCpuStepsBitwise) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device visible to libtorch";
  torch::manual_seed(1);
  const AdamW adamw({.lr = 1e-3, .weight_decay = 0.1});
  const int64_t n = 1'000'003;
  torch::Tensor p_cpu = torch::randn({n});
  std::vector<torch::Tensor> s_cpu = {torch::zeros({n}), torch::zeros({n})};
  torch::Tensor p_gpu = p_cpu.cuda();
  std::vector<torch::Tensor> s_gpu = {s_cpu[0].cuda(), s_cpu[1].cuda()};
  torch::Tensor bf16 = torch::empty({n}, torch::dtype(torch::kBFloat16).device(torch::kCUDA));
  for (int64_t step = 1; step <= 4; ++step) {
    const torch::Tensor g = torch::randn({n});
    adamw.update(p_cpu, g, s_cpu, step);
    adamw.update_with_bf16_copy(p_gpu, g.cuda(), s_gpu, step, bf16);
  }
  EXPECT_TRUE(torch::equal(p_gpu.cpu(), p_cpu));
  EXPECT_TRUE(torch::equal(s_gpu[0].cpu(), s_cpu[0]));
  EXPECT_TRUE(torch::equal(s_gpu[1].cpu(), s_cpu[1]));
  EXPECT_TRUE(torch::equal(bf16.cpu(), p_cpu.to(torch::kBFloat16)));
}

TEST(CudaSumOfSquares, IsADeviceDoubleCloseToTheCpuValue) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device visible to libtorch";
  std::vector<torch::Tensor> cpu = {torch::randn({123457}), torch::randn({3}) * 100};
  std::vector<torch::Tensor> gpu = {cpu[0].cuda(), cpu[1].cuda()};
  const torch::Tensor on_gpu = internal::sum_of_squares(gpu);
  EXPECT_TRUE(on_gpu.is_cuda());
  EXPECT_EQ(on_gpu.scalar_type(), torch::kDouble);
  const double expected = internal::sum_of_squares(cpu).item<double>();
  EXPECT_NEAR(on_gpu.item<double>(), expected, expected * 1e-6);  // CPU: float norms, squared
}

}  // namespace
}  // namespace loom::optim
