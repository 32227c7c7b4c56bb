// Check macros for the CUDA runtime and NCCL: each names the call, the error string, the
// library version and the source location, and throws loom::CommError. Compiled with CUDA only.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "loom/error.h"

#define LOOM_CHECK_CUDA(call)                                                                  \
  do {                                                                                         \
    cudaError_t loom_cuda_err_ = (call);                                                       \
    if (loom_cuda_err_ != cudaSuccess)                                                         \
      throw ::loom::CommError(                                                                 \
          ::loom::detail::concat(#call, " failed: ", cudaGetErrorString(loom_cuda_err_), " [", \
                                 __FILE__, ":", __LINE__, "]"));                               \
  } while (0)

// ncclInProgress is not an error for a non-blocking communicator: the caller polls
// ncclCommGetAsyncError until the call has finished.
#define LOOM_CHECK_NCCL(call)                                                                 \
  do {                                                                                        \
    ncclResult_t loom_nccl_res_ = (call);                                                     \
    if (loom_nccl_res_ != ncclSuccess && loom_nccl_res_ != ncclInProgress)                    \
      throw ::loom::CommError(::loom::detail::concat(                                         \
          #call, " failed: ", ncclGetErrorString(loom_nccl_res_), " (NCCL ", NCCL_MAJOR, ".", \
          NCCL_MINOR, ".", NCCL_PATCH, ") [", __FILE__, ":", __LINE__, "]"));                 \
  } while (0)
