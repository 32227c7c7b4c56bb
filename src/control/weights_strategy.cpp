// publish_parameters (loom/control/weights.h): a strategy's full parameters to a publisher. Apart
// from weights.cpp so that the segment and sockets compile without the torch::nn headers.
#include <torch/nn/module.h>

#include <map>
#include <string>

#include "loom/control/weights.h"
#include "loom/error.h"
#include "loom/parallel/data_parallel.h"
#include "loom/parallel/fsdp.h"

namespace loom::control {

void publish_parameters(parallel::Strategy& strategy, WeightPublisher* publisher, int64_t version) {
  const std::string advice =
      "publish_parameters gathers data-parallel shards only; under tensor or pipeline "
      "parallelism publish each model-parallel rank's own parameters (strategy.module()) under a "
      "name of its own";
  if (auto* fsdp = dynamic_cast<parallel::FullyShardedDataParallel*>(&strategy)) {
    LOOM_CHECK(!fsdp->options().model_parallel.active(), InvalidArgument, advice);
    const std::map<std::string, at::Tensor> full = fsdp->gather_full_parameters();
    if (publisher != nullptr) publisher->publish(version, full);
    return;
  }
  auto* dp = dynamic_cast<parallel::DataParallel*>(&strategy);
  LOOM_CHECK(dp != nullptr, InvalidArgument,
             "publish_parameters knows DataParallel and FullyShardedDataParallel; for another "
             "strategy publish its module's parameters with WeightPublisher::publish");
  LOOM_CHECK(!dp->options().model_parallel.active(), InvalidArgument, advice);
  if (publisher == nullptr) return;
  std::map<std::string, at::Tensor> parameters;
  for (const auto& item : strategy.module().named_parameters()) {
    parameters.emplace(item.key(), item.value());
  }
  publisher->publish(version, parameters);
}

}  // namespace loom::control
