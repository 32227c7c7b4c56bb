// Parameters as pieces of a model split by tensor and pipeline parallelism (placement.h).
#include "parallel/placement.h"

#include "loom/error.h"
#include "loom/parallel/tensor_parallel.h"

namespace loom::parallel::internal {

std::map<std::string, Placement> placements(const torch::nn::Module& module,
                                            const ModelParallel& mp) {
  const bool tp_rank0 = mp.tp == nullptr || mp.tp->rank() == 0;
  std::map<std::string, Placement> out;
  for (const tp::ShardedParameter& p : tp::sharded_parameters(module)) {
    Placement placement{tp::checkpoint_piece(p.tensor, p.spec, mp.tp),
                        !p.spec.replicated() || tp_rank0, nullptr};
    out.emplace(p.name, std::move(placement));
  }
  for (const ModelParallel::Tied& tied : mp.tied) {
    const auto it = out.find(tied.name);
    LOOM_CHECK(it != out.end(), InvalidArgument, "ModelParallel: the tied parameter '", tied.name,
               "' is not a parameter of the module");
    LOOM_CHECK(tied.group != nullptr, InvalidArgument, "ModelParallel: the tied parameter '",
               tied.name, "' has no group");
    it->second.tied = tied.group;
    it->second.primary = it->second.primary && tied.group->rank() == 0;
  }
  for (auto& [name, placement] : out) placement.piece.written = placement.primary;
  return out;
}

void sum_over_model(at::Tensor& squares, const ModelParallel& mp,
                    std::chrono::milliseconds timeout) {
  for (comm::Group* group : {mp.tp, mp.pp}) {
    if (group != nullptr && group->size() > 1) {
      group->all_reduce(squares, {comm::ReduceOp::kSum, timeout})->wait(timeout);
    }
  }
}

void sum_tied_gradients(const std::vector<std::pair<at::Tensor, comm::Group*>>& grads,
                        std::chrono::milliseconds timeout) {
  for (const auto& [grad, group] : grads) {
    at::Tensor in_place = grad;  // the same storage
    group->all_reduce(in_place, {comm::ReduceOp::kSum, timeout})->wait(timeout);
  }
}

}  // namespace loom::parallel::internal
