// measure_cuda_bf16_matmul_peak without CUDA support: there is no GPU to measure.
#include "loom/error.h"
#include "loom/metrics/flops.h"

namespace loom::metrics {

PeakFlops measure_cuda_bf16_matmul_peak(int index, const MatmulPeakOptions& /*options*/) {
  throw InvalidArgument(detail::concat("measure_matmul_peak: cuda:", index,
                                       " cannot be measured: this Loom was built without CUDA "
                                       "(LOOM_WITH_CUDA=OFF)"));
}

}  // namespace loom::metrics
