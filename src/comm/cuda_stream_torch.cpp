// current_compute_stream from torch's stream pool (libtorch with CUDA).
#include <c10/cuda/CUDAStream.h>

#include "comm/cuda_stream.h"

namespace loom::comm {

cudaStream_t current_compute_stream(int device) {
  return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
}

}  // namespace loom::comm
