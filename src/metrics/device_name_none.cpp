// cuda_device_name without CUDA support: there is no device to name.
#include "loom/metrics/flops.h"

namespace loom::metrics {

std::string cuda_device_name(int /*index*/) { return ""; }

}  // namespace loom::metrics
