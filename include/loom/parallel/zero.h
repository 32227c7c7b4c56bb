// ZeRO stages for parallel::DataParallel: how much of the training state each of W ranks keeps.
//
// Every stage flattens the parameters of a bucket into one contiguous buffer padded to a
// multiple of W; rank r owns elements [r * P/W, (r+1) * P/W) of a bucket of padded size P.
//   kNone  plain DDP: gradients all-reduced, every rank steps every parameter (replicated state).
//   kOne   ZeRO-1: gradients all-reduced; each rank keeps optimizer state (and fp32 master
//          weights) for its slice only, steps it, and the slices are all-gathered back.
//   kTwo   ZeRO-2: as kOne, but gradients are reduce-scattered: each rank receives only the
//          reduced gradient of its slice, and keeps no full-size gradient buffer (a bucket's
//          buffer lives from its first gradient until its reduce-scatter completes).
// ZeRO-3 (parameters sharded too, gathered before use) is FullyShardedDataParallel (fsdp.h).
#pragma once

#include "loom/visibility.h"

namespace loom::parallel {

enum class ZeroStage { kNone = 0, kOne = 1, kTwo = 2 };

LOOM_API const char* to_string(ZeroStage stage);

}  // namespace loom::parallel
