// The NCCL entry points of a Loom built without CUDA: they say so.
#include "loom/comm/nccl.h"
#include "loom/error.h"

namespace loom::comm {

bool nccl_available() { return false; }

std::unique_ptr<Group> new_nccl_group(Store&, int, int, const NcclOptions&) {
  throw InvalidArgument(
      "this Loom was built without CUDA, so the NCCL backend is unavailable: rebuild with "
      "-DLOOM_WITH_CUDA=ON against a CUDA-enabled libtorch, or use new_gloo_group");
}

}  // namespace loom::comm
