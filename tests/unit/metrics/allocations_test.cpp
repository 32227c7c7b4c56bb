// The counting CPU allocator: bytes by category, peaks, frees from other threads, tensors from
// before counting, nesting of scopes.
#include "loom/metrics/allocations.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <thread>

namespace loom::metrics {
namespace {

constexpr int64_t kMiB = 1 << 20;

TEST(CpuAllocations, TensorsAreChargedToTheirScopesCategoryUntilFreed) {
  const at::Tensor before = at::empty({kMiB}, at::kByte);  // allocated before counting (maybe)
  count_cpu_allocations();
  EXPECT_TRUE(counting_cpu_allocations());
  reset_cpu_allocation_peaks();
  const CpuAllocations start = cpu_allocations();
  {
    at::Tensor activations;
    at::Tensor gradients;
    {
      MemoryCategoryScope outer(MemoryCategory::kActivations);
      activations = at::empty({2 * kMiB}, at::kByte);
      {
        MemoryCategoryScope inner(MemoryCategory::kGradients);
        gradients = at::empty({kMiB / 4}, at::kFloat);  // 1 MiB
      }
      activations = at::cat({activations, at::empty({kMiB}, at::kByte)});  // 3 MiB, old freed
    }
    const CpuAllocations during = cpu_allocations();
    EXPECT_EQ(during.of(MemoryCategory::kActivations).live_bytes -
                  start.of(MemoryCategory::kActivations).live_bytes,
              3 * kMiB);
    // The peak held the 2 MiB, the 1 MiB and the 3 MiB at once (cat before the old was freed).
    EXPECT_EQ(during.of(MemoryCategory::kActivations).peak_bytes -
                  start.of(MemoryCategory::kActivations).live_bytes,
              6 * kMiB);
    EXPECT_EQ(during.of(MemoryCategory::kGradients).live_bytes -
                  start.of(MemoryCategory::kGradients).live_bytes,
              kMiB);
    EXPECT_GE(during.allocations - start.allocations, 4);
    // Freed on another thread: taken off the category it was charged to.
    std::thread([g = std::move(gradients)]() mutable { g = at::Tensor(); }).join();
  }
  const CpuAllocations end = cpu_allocations();
  EXPECT_EQ(end.of(MemoryCategory::kActivations).live_bytes,
            start.of(MemoryCategory::kActivations).live_bytes);
  EXPECT_EQ(end.of(MemoryCategory::kGradients).live_bytes,
            start.of(MemoryCategory::kGradients).live_bytes);
  EXPECT_GE(end.total.peak_bytes - start.total.live_bytes, 7 * kMiB);
  reset_cpu_allocation_peaks();
  EXPECT_EQ(cpu_allocations().of(MemoryCategory::kActivations).peak_bytes,
            end.of(MemoryCategory::kActivations).live_bytes);
  EXPECT_EQ(before.numel(), kMiB);  // freed after the test, through its own allocator
}

TEST(CpuAllocations, CategoriesHaveNames) {
  EXPECT_STREQ(to_string(MemoryCategory::kOptimizerState), "optimizer_state");
  EXPECT_STREQ(to_string(MemoryCategory::kOther), "other");
}

}  // namespace
}  // namespace loom::metrics
