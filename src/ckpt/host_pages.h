// Large host buffers for the checkpointer (staging, read buffers), backed by transparent huge
// pages where the kernel allows it. Private to Loom.
//
// Why: the first touch of freshly allocated memory costs a page fault per page. On the
// development VM a fault per 4 KiB page made the first copy of 1 GiB into new staging memory
// take 4.3 s; with 2 MiB pages it took 0.16 s (`madvise(MADV_HUGEPAGE)`; the kernel's THP mode
// there is "madvise"). Where the kernel refuses, the memory is ordinary pages.
#pragma once

#include <cstddef>

namespace loom::ckpt::internal {

// At least `bytes` of memory aligned to 4 KiB (to 2 MiB from 2 MiB up, asked to be huge
// pages), released with std::free. Null when the allocation fails.
char* allocate_pages(size_t bytes);

}  // namespace loom::ckpt::internal
