// Guards against libtorch running on Debian's reference BLAS: without libopenblas0-pthread a
// 1024^3 fp32 matmul runs at 3-5 GFLOP/s instead of ~100. The floor is generous on purpose.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <iostream>

namespace {

TEST(Blas, MatmulIsNotTheReferenceBlas) {
  constexpr int64_t n = 1024;
  constexpr double kFloorGflops = 15.0;
  torch::NoGradGuard no_grad;
  auto a = torch::randn({n, n});
  auto b = torch::randn({n, n});
  torch::mm(a, b);  // warm-up: thread pool, page faults
  double best = 0;
  for (int trial = 0; trial < 3; ++trial) {
    auto start = std::chrono::steady_clock::now();
    auto c = torch::mm(a, b);
    double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best = std::max(best, 2.0 * n * n * n / seconds / 1e9);
  }
  std::cout << "fp32 matmul 1024^3: " << best << " GFLOP/s with " << at::get_num_threads()
            << " threads (floor " << kFloorGflops << ")" << std::endl;
  RecordProperty("gflops", std::to_string(best));
  EXPECT_GT(best, kFloorGflops) << "torch matmul is slow: is libopenblas0-pthread installed? "
                                   "(tools/install-deps.sh installs it)";
}

}  // namespace
