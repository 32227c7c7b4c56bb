// The caller's current compute stream on a device: torch's current CUDA stream when libtorch
// has CUDA (cuda_stream_torch.cpp), else the legacy default stream (cuda_stream_default.cpp;
// such a libtorch cannot make CUDA tensors, so no NCCL op gets that far).
#pragma once

#include <cuda_runtime_api.h>

namespace loom::comm {

cudaStream_t current_compute_stream(int device);

}  // namespace loom::comm
