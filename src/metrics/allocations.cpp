// The counting CPU allocator (allocations.h): a c10::Allocator that forwards to the one it
// replaces and keeps, per live pointer, its size and category.
#include "loom/metrics/allocations.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <mutex>
#include <unordered_map>

#include "loom/error.h"

namespace loom::metrics {
namespace {

thread_local MemoryCategory current_category = MemoryCategory::kOther;

struct Charge {
  size_t bytes = 0;
  MemoryCategory category = MemoryCategory::kOther;
};

// The wrapper keeps the raw interface of the allocator it wraps (context == data pointer), so
// code that uses raw_allocate / raw_deallocate on the CPU allocator keeps working.
class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base), base_free_(base->raw_deleter()) {}

  c10::DataPtr allocate(size_t n) const override {
    c10::DataPtr inner = base_->allocate(n);
    void* data = inner.get();
    if (data == nullptr) return inner;  // zero bytes: nothing to count
    void* context = inner.release_context();
    LOOM_CHECK(context == data, Error,
               "count_cpu_allocations: the CPU allocator's context differs from its pointer");
    charge(data, n);
    return {data, data, &CountingAllocator::free_counted, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &CountingAllocator::free_counted; }

  CpuAllocations snapshot() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return counts_;
  }
  std::optional<MemoryCategory> category_of(const void* data) const {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = live_.find(const_cast<void*>(data));
    if (it == live_.end()) return std::nullopt;
    return it->second.category;
  }
  void reset_peaks() {
    std::lock_guard<std::mutex> lock(mutex_);
    counts_.total.peak_bytes = counts_.total.live_bytes;
    for (AllocatedBytes& c : counts_.by_category) c.peak_bytes = c.live_bytes;
  }

  static CountingAllocator* instance;  // set once, never freed (c10 keeps the raw pointer)

 private:
  void charge(void* data, size_t n) const {
    std::lock_guard<std::mutex> lock(mutex_);
    live_[data] = Charge{n, current_category};
    add(current_category, static_cast<int64_t>(n));
    ++counts_.allocations;
  }
  void add(MemoryCategory category, int64_t bytes) const {
    AllocatedBytes& c = counts_.by_category[static_cast<int>(category)];
    c.live_bytes += bytes;
    c.peak_bytes = std::max(c.peak_bytes, c.live_bytes);
    counts_.total.live_bytes += bytes;
    counts_.total.peak_bytes = std::max(counts_.total.peak_bytes, counts_.total.live_bytes);
  }
  static void free_counted(void* data) {
    CountingAllocator* self = instance;
    {
      std::lock_guard<std::mutex> lock(self->mutex_);
      const auto it = self->live_.find(data);
      if (it != self->live_.end()) {
        self->add(it->second.category, -static_cast<int64_t>(it->second.bytes));
        self->live_.erase(it);
      }
    }
    self->base_free_(data);
  }

  // Constant after construction.
  c10::Allocator* const base_;
  const c10::DeleterFnPtr base_free_;
  // State below is protected by mutex_.
  mutable std::mutex mutex_;
  mutable std::unordered_map<void*, Charge> live_;
  mutable CpuAllocations counts_;
};

CountingAllocator* CountingAllocator::instance = nullptr;
std::mutex install_mutex;

}  // namespace

const char* to_string(MemoryCategory category) {
  switch (category) {
    case MemoryCategory::kOther:
      return "other";
    case MemoryCategory::kParameters:
      return "parameters";
    case MemoryCategory::kGradients:
      return "gradients";
    case MemoryCategory::kOptimizerState:
      return "optimizer_state";
    case MemoryCategory::kActivations:
      return "activations";
  }
  return "?";
}

void count_cpu_allocations() {
  std::lock_guard<std::mutex> lock(install_mutex);
  if (CountingAllocator::instance != nullptr) return;
  c10::Allocator* base = c10::GetCPUAllocator();
  LOOM_CHECK(base != nullptr && base->raw_deleter() != nullptr, Error,
             "count_cpu_allocations: c10's CPU allocator has no raw deleter to forward to");
  // c10 keeps the raw pointer for the rest of the process; so does Loom.
  CountingAllocator::instance = new CountingAllocator(base);
  c10::SetCPUAllocator(CountingAllocator::instance, /*priority=*/255);
}

bool counting_cpu_allocations() {
  std::lock_guard<std::mutex> lock(install_mutex);
  return CountingAllocator::instance != nullptr;
}

CpuAllocations cpu_allocations() {
  std::lock_guard<std::mutex> lock(install_mutex);
  return CountingAllocator::instance ? CountingAllocator::instance->snapshot() : CpuAllocations{};
}

void reset_cpu_allocation_peaks() {
  std::lock_guard<std::mutex> lock(install_mutex);
  if (CountingAllocator::instance) CountingAllocator::instance->reset_peaks();
}

std::optional<MemoryCategory> category_of_allocation(const void* data) {
  std::lock_guard<std::mutex> lock(install_mutex);
  if (!CountingAllocator::instance) return std::nullopt;
  return CountingAllocator::instance->category_of(data);
}

MemoryCategoryScope::MemoryCategoryScope(MemoryCategory category) : previous_(current_category) {
  current_category = category;
}

MemoryCategoryScope::~MemoryCategoryScope() { current_category = previous_; }

}  // namespace loom::metrics
