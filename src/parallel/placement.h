// How DataParallel and FSDP see a parameter under model parallelism (ModelParallel,
// strategy.h): its piece of the whole model's tensor, whether this rank is the one that counts
// and writes it, and the sums over the model-parallel ranks. Private to src/parallel/.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <chrono>
#include <map>
#include <string>
#include <vector>

#include "loom/ckpt/state.h"
#include "loom/parallel/strategy.h"

namespace loom::parallel::internal {

struct Placement {
  ckpt::Sharding piece;  // this rank's tensor in the whole model's (the whole of it: a block)
  // This rank counts the parameter in the gradient norm and writes it: every tensor-parallel
  // rank a sharded parameter, tp rank 0 a replicated one, and of a tied parameter's holders
  // only its group's rank 0.
  bool primary = true;
  comm::Group* tied = nullptr;  // the group its gradient is summed over first, if tied
};

// Every parameter of `module` by name. InvalidArgument naming a tied parameter the module does
// not have.
std::map<std::string, Placement> placements(const torch::nn::Module& module,
                                            const ModelParallel& model_parallel);

// Adds a sum of squares (a 1-element double tensor, on any device the groups take) over the
// model's tensor-parallel and pipeline ranks, in place.
void sum_over_model(at::Tensor& squares, const ModelParallel& model_parallel,
                    std::chrono::milliseconds timeout);

// Sums each tied parameter's gradient `grads[i]` over its group, in place (the strategies call it
// with the gradients accumulated under no_sync).
void sum_tied_gradients(const std::vector<std::pair<at::Tensor, comm::Group*>>& grads,
                        std::chrono::milliseconds timeout);

}  // namespace loom::parallel::internal
