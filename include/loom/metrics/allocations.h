// Counted CPU allocations: bytes that libtorch's CPU allocator has handed out and not freed,
// now and at their peak, in total and by what they hold (parameters, gradients, optimizer
// state, activations), the way torch.cuda.memory_allocated() counts device memory. For
// benchmarks and tests that must show memory from the allocations rather than from tensor
// sizes.
//
//   loom::metrics::count_cpu_allocations();           // once, early (process-wide)
//   loom::metrics::reset_cpu_allocation_peaks();
//   { loom::metrics::MemoryCategoryScope scope(loom::metrics::MemoryCategory::kActivations);
//     loss = model->forward(x); }                      // allocations here count as activations
//   auto stats = loom::metrics::cpu_allocations();     // stats.of(kActivations).peak_bytes
//
// count_cpu_allocations() installs a counting wrapper as c10's CPU allocator. Only allocations
// made after it are counted (a tensor allocated before is freed through its own allocator and
// never seen). Each allocation is charged to the innermost MemoryCategoryScope of the thread
// that makes it (kOther outside any), and its free is taken off that same category, whichever
// thread frees it. Loom's DataParallel opens scopes around its parameter, gradient and
// optimizer-state buffers; autograd's own temporaries count where the caller's scope says.
// CPU memory only (CUDA has its caching allocator's statistics).
//
// Thread safety: every function may be called from any thread. Counting costs a lock and a
// hash-map update per allocation and free, so it is for measurement, not for production runs.
#pragma once

#include <array>
#include <cstdint>
#include <optional>

#include "loom/visibility.h"

namespace loom::metrics {

enum class MemoryCategory {
  kOther = 0,
  kParameters,
  kGradients,
  kOptimizerState,
  kActivations,
};
inline constexpr int kMemoryCategories = 5;

LOOM_API const char* to_string(MemoryCategory category);

struct AllocatedBytes {
  int64_t live_bytes = 0;  // allocated and not yet freed
  int64_t peak_bytes = 0;  // the most live_bytes since counting began or the last reset
};

struct CpuAllocations {
  AllocatedBytes total;  // every category together (its peak is the peak of the sum)
  std::array<AllocatedBytes, kMemoryCategories> by_category;
  int64_t allocations = 0;  // allocate calls counted so far
  const AllocatedBytes& of(MemoryCategory c) const { return by_category[static_cast<int>(c)]; }
};

// Starts counting (idempotent). Throws loom::Error if c10's CPU allocator cannot be wrapped.
LOOM_API void count_cpu_allocations();
LOOM_API bool counting_cpu_allocations();
// The counts now; all zero before count_cpu_allocations().
LOOM_API CpuAllocations cpu_allocations();
// Every peak (total and per category) := its live bytes now.
LOOM_API void reset_cpu_allocation_peaks();
// The category a live counted allocation was charged to, by the start of its block (a
// tensor's storage().data()); empty for memory the counter did not allocate.
LOOM_API std::optional<MemoryCategory> category_of_allocation(const void* data);

// RAII: allocations this thread makes during the scope's lifetime count under `category`;
// scopes nest (the innermost wins) and restore the outer category when they end. Cheap (one
// thread-local write); harmless when counting is off.
class LOOM_API MemoryCategoryScope {
 public:
  explicit MemoryCategoryScope(MemoryCategory category);
  ~MemoryCategoryScope();
  MemoryCategoryScope(const MemoryCategoryScope&) = delete;
  MemoryCategoryScope& operator=(const MemoryCategoryScope&) = delete;

 private:
  MemoryCategory previous_;
};

}  // namespace loom::metrics
