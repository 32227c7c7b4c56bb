// Element-wise reduction kernels that Gloo calls while it reduces: c[i] = a[i] op b[i].
//
// Gloo's own gloo::sum<T> and friends are header templates, so they compile with the including
// file's flags; at -O2 GCC does not vectorise them (the pointers may alias), and on large
// all-reduces that scalar loop cost Loom ~10% against libtorch's copy. These are compiled at
// -O3, handle the in-place cases Gloo uses (c == a, c == b) without aliasing, and are cloned
// for AVX2 where the CPU has it. Private to Loom.
#pragma once

#include <cstddef>

#include "loom/comm/group.h"

namespace loom::comm {

using ReduceKernel = void (*)(void* c, const void* a, const void* b, size_t n);

// The kernel for op over T (float, double, int32_t, int64_t, uint8_t); kAvg sums.
template <typename T>
ReduceKernel reduce_kernel(ReduceOp op);

}  // namespace loom::comm
