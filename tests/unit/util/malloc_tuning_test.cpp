// util::keep_freed_memory: a freed block of activation size is reused without faulting its
// pages in again; with glibc's defaults (set back for the comparison) the same block is handed
// back to the system and faults every page on its next use.
#include "util/malloc_tuning.h"

#include <gtest/gtest.h>
#include <sys/resource.h>

#include <cstdlib>  // defines __GLIBC__ where the C library is glibc

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace {

long minor_faults() {
  rusage usage{};
  getrusage(RUSAGE_THREAD, &usage);
  return usage.ru_minflt;
}

constexpr size_t kBytes = 8 << 20;  // 2,048 pages

// Allocates, writes one byte per page, frees; returns the page faults that took.
long faults_of_one_use() {
  const long before = minor_faults();
  volatile char* block = static_cast<volatile char*>(std::malloc(kBytes));
  for (size_t i = 0; i < kBytes; i += 4096) block[i] = 1;
  std::free(const_cast<char*>(block));
  return minor_faults() - before;
}

TEST(KeepFreedMemory, AFreedBlockIsReusedWithoutFaultingItsPagesAgain) {
  if (!loom::util::keep_freed_memory()) {
    GTEST_SKIP() << "not glibc's allocator (a sanitizer's replaces it): nothing to set";
  }
  faults_of_one_use();  // the first use faults the pages in
  EXPECT_LT(faults_of_one_use(), 64) << "the freed 8 MiB were kept and reused";

#if defined(__GLIBC__)
  // glibc's start-up values: the block is mapped and unmapped every time.
  ASSERT_EQ(mallopt(M_MMAP_THRESHOLD, 128 * 1024), 1);
  ASSERT_EQ(mallopt(M_TRIM_THRESHOLD, 128 * 1024), 1);
  faults_of_one_use();
  EXPECT_GT(faults_of_one_use(), 1000) << "without keeping, every page faults again";
  ASSERT_TRUE(loom::util::keep_freed_memory());
#endif
}

}  // namespace
