// current_compute_stream for a libtorch without CUDA: the legacy default stream.
#include "comm/cuda_stream.h"

namespace loom::comm {

cudaStream_t current_compute_stream(int) { return cudaStreamLegacy; }

}  // namespace loom::comm
