// Vectorised reduction kernels for Gloo (see reduce_kernels.h). Compiled with -O3.
#include "comm/reduce_kernels.h"

#include <algorithm>
#include <cstdint>

// AVX2 and generic clones, picked at load time by an IFUNC resolver. Not under ThreadSanitizer:
// the resolver runs while the dynamic loader relocates libloom, before TSan's runtime starts,
// and the instrumentation the compiler puts in it crashes there.
#if defined(__SANITIZE_THREAD__)
#define LOOM_SIMD_CLONES
#else
#define LOOM_SIMD_CLONES __attribute__((target_clones("avx2", "default")))
#endif

namespace loom::comm {
namespace {

struct Sum {
  template <typename T>
  static T apply(T x, T y) {
    return x + y;
  }
};
struct Min {
  template <typename T>
  static T apply(T x, T y) {
    return std::min(x, y);
  }
};
struct Max {
  template <typename T>
  static T apply(T x, T y) {
    return std::max(x, y);
  }
};

template <typename Op, typename T>
LOOM_SIMD_CLONES void accumulate(T* __restrict__ c, const T* __restrict__ b, size_t n) {
  for (size_t i = 0; i < n; ++i) c[i] = Op::apply(c[i], b[i]);
}

template <typename Op, typename T>
LOOM_SIMD_CLONES void combine(T* __restrict__ c, const T* __restrict__ a, const T* __restrict__ b,
                              size_t n) {
  for (size_t i = 0; i < n; ++i) c[i] = Op::apply(a[i], b[i]);
}

// The element-wise ops are commutative, so c == b reduces to the c == a case.
template <typename Op, typename T>
void reduce(void* c, const void* a, const void* b, size_t n) {
  T* out = static_cast<T*>(c);
  if (c == a) {
    accumulate<Op, T>(out, static_cast<const T*>(b), n);
  } else if (c == b) {
    accumulate<Op, T>(out, static_cast<const T*>(a), n);
  } else {
    combine<Op, T>(out, static_cast<const T*>(a), static_cast<const T*>(b), n);
  }
}

}  // namespace

template <typename T>
ReduceKernel reduce_kernel(ReduceOp op) {
  switch (op) {
    case ReduceOp::kMin:
      return &reduce<Min, T>;
    case ReduceOp::kMax:
      return &reduce<Max, T>;
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      break;
  }
  return &reduce<Sum, T>;
}

template ReduceKernel reduce_kernel<float>(ReduceOp);
template ReduceKernel reduce_kernel<double>(ReduceOp);
template ReduceKernel reduce_kernel<int32_t>(ReduceOp);
template ReduceKernel reduce_kernel<int64_t>(ReduceOp);
template ReduceKernel reduce_kernel<uint8_t>(ReduceOp);

}  // namespace loom::comm
