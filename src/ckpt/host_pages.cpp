// Large host buffers backed by transparent huge pages (see host_pages.h).
#include "ckpt/host_pages.h"

#include <sys/mman.h>

#include <cstdlib>

namespace loom::ckpt::internal {

char* allocate_pages(size_t bytes) {
  constexpr size_t kPage = size_t{4} << 10, kHugePage = size_t{2} << 20;
  const size_t alignment = bytes >= kHugePage ? kHugePage : kPage;
  const size_t rounded = (bytes + alignment - 1) / alignment * alignment;
  char* data = static_cast<char*>(std::aligned_alloc(alignment, rounded));
  // Only a hint: without THP the memory is ordinary pages.
  if (data != nullptr && alignment == kHugePage) (void)::madvise(data, rounded, MADV_HUGEPAGE);
  return data;
}

}  // namespace loom::ckpt::internal
