#include "util/malloc_tuning.h"

#include <cstdlib>  // defines __GLIBC__ where the C library is glibc

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace loom::util {

namespace {
// A sanitizer's allocator replaces glibc's and ignores its settings (as tests/harness/harness.h
// detects it).
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitizerAllocator = true;
#else
constexpr bool kSanitizerAllocator = false;
#endif
}  // namespace

bool keep_freed_memory() {
#if defined(__GLIBC__)
  if (kSanitizerAllocator) return false;
  // mallopt returns 1 on success. Setting either value also turns off glibc's dynamic
  // adjustment of both.
  const bool mmap_ok = mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1;
  const bool trim_ok = mallopt(M_TRIM_THRESHOLD, 1 << 30) == 1;
  return mmap_ok && trim_ok;
#else
  return false;
#endif
}

}  // namespace loom::util
