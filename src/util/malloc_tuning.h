// How the process's C allocator treats freed memory. glibc serves allocations above its mmap
// threshold (128 KiB at start, raised up to 32 MiB as such blocks are freed) with fresh mappings
// and returns them on free, and trims the heap's free top above 128 KiB: a training step that
// frees and re-allocates the same activations every step then faults every page of them in
// again. On the 2-vCPU VM a plain libtorch training step of a 3.4M-parameter transformer took
// 113 ms with 5,300 page faults per step, and 62 ms without them (docs/benchmarks.md, the
// trainer section).
#pragma once

namespace loom::util {

// Keeps freed memory in the process: allocations up to 32 MiB (glibc's largest mmap threshold)
// come from the heap, and the heap is not trimmed below 1 GiB of free space. Returns false
// where there is nothing to set (not glibc, or a sanitizer's allocator in place of it).
// Process-wide; call it once, before the training loop allocates.
bool keep_freed_memory();

}  // namespace loom::util
