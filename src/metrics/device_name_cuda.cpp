// cuda_device_name through the CUDA runtime (compiled only with CUDA).
#include <cuda_runtime.h>

#include "loom/error.h"
#include "loom/metrics/flops.h"

namespace loom::metrics {

std::string cuda_device_name(int index) {
  cudaDeviceProp props{};
  cudaError_t err = cudaGetDeviceProperties(&props, index);
  LOOM_CHECK(err == cudaSuccess, Error, "cudaGetDeviceProperties(", index,
             ") failed: ", cudaGetErrorString(err), " (", __FILE__, ":", __LINE__, ")");
  return props.name;
}

}  // namespace loom::metrics
