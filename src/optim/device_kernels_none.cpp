// device_kernels.h without CUDA: such a build has no CUDA tensors, so nothing calls these.
#include "optim/device_kernels.h"

#include "loom/error.h"

namespace loom::optim::internal {

void fused_adamw(const AdamWStep&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                 const at::Tensor&, const at::Tensor&) {
  throw InvalidArgument(
      "fused AdamW: this Loom was built without CUDA (LOOM_WITH_CUDA=OFF); rebuild with CUDA to "
      "update CUDA tensors");
}

at::Tensor fused_sum_of_squares(const std::vector<at::Tensor>&) {
  throw InvalidArgument(
      "fused sum of squares: this Loom was built without CUDA (LOOM_WITH_CUDA=OFF); rebuild with "
      "CUDA to reduce CUDA tensors");
}

}  // namespace loom::optim::internal
