// The 'optim' blob DataParallel and FSDP save beside their tensors ({"optimizer": name,
// "step": n, ...}), read back in one place. Private to src/parallel/.
#pragma once

#include <cstdint>

#include "loom/ckpt/state.h"
#include "loom/optim/flat_optimizer.h"

namespace loom::parallel::internal {

// The step `source`'s 'optim' blob records, for `who` (e.g. "FSDP::load_state", which starts
// every message). No blob, or a blob saved with another optimizer than `optimizer` (when not
// null), is InvalidArgument; a blob that is not JSON, lacks a field or holds a step that is
// not an integer is CorruptData quoting it.
int64_t read_optim_blob(const ckpt::State& source, const optim::FlatOptimizer* optimizer,
                        const char* who);

}  // namespace loom::parallel::internal
