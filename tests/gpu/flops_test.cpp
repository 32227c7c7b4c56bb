// The GPU's datasheet and measured bf16 matmul peaks (loom/metrics/flops.h), printed side by
// side for tools/gpu-check.sh's table. Skipped where libtorch has no CUDA or no GPU is visible.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>

#include "loom/metrics/flops.h"

namespace loom::metrics {
namespace {

TEST(CudaPeak, MeasuredBf16MatmulBesideTheDatasheet) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device visible to libtorch";
  const std::string name = cuda_device_name(0);
  const PeakFlops measured = measure_matmul_peak(c10::Device(c10::kCUDA, 0));
  EXPECT_EQ(measured.source, "measured-cuda-bf16-matmul");
  const auto datasheet = datasheet_peak(name);
  std::printf("gpu-check: device '%s' measured bf16 matmul %.1f TFLOP/s, datasheet %s\n",
              name.c_str(), measured.flops_per_second / 1e12,
              datasheet ? (std::to_string(datasheet->flops_per_second / 1e12) + " TFLOP/s").c_str()
                        : "unknown (not in the table)");
  if (datasheet) {
    // A healthy GPU reaches well over half its dense peak on an 8192^3 bf16 product (an H200
    // here: ~790 of 989); under a third means throttling or a broken cuBLAS.
    EXPECT_GT(measured.flops_per_second, datasheet->flops_per_second / 3) << name;
    EXPECT_LT(measured.flops_per_second, datasheet->flops_per_second * 1.1) << name;
  }
  const PeakFlops used = peak_flops(c10::Device(c10::kCUDA, 0));
  EXPECT_EQ(used.source.rfind(datasheet ? "datasheet:" : "measured-cuda-bf16-matmul", 0), 0u)
      << used.source;
}

}  // namespace
}  // namespace loom::metrics
