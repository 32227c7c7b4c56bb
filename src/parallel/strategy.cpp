// parallel::Strategy's config: the mode and the factory.
#include "loom/parallel/strategy.h"

#include "loom/error.h"
#include "loom/parallel/data_parallel.h"
#include "loom/parallel/fsdp.h"

namespace loom::parallel {

const char* to_string(Mode mode) {
  switch (mode) {
    case Mode::kDdp:
      return "ddp";
    case Mode::kZero1:
      return "zero1";
    case Mode::kZero2:
      return "zero2";
    case Mode::kFsdp:
      return "fsdp";
  }
  return "?";
}

ConfigSchema strategy_schema() {
  ConfigSchema s;
  s.add("parallel.mode", "ddp",
        "ddp (replicated), zero1 (optimizer state sharded), zero2 (gradients too) or fsdp "
        "(parameters too, gathered around each unit's forward and backward)");
  s.merge(DataParallelOptions::schema());
  s.merge(FsdpOptions::schema());
  return s;
}

Mode mode_from(const Config& config) {
  const std::string mode = config.get<std::string>("parallel.mode");
  for (Mode m : {Mode::kDdp, Mode::kZero1, Mode::kZero2, Mode::kFsdp}) {
    if (mode == to_string(m)) return m;
  }
  throw ConfigError(loom::detail::concat("parallel.mode is '", mode,
                                         "'; use ddp, zero1, zero2 or fsdp (docs/parallel.md)"));
}

std::unique_ptr<Strategy> make_strategy(std::shared_ptr<torch::nn::Module> module,
                                        comm::Group& group, comm::Group& control,
                                        const Config& config, const ModelParallel& model_parallel) {
  if (mode_from(config) == Mode::kFsdp) {
    FsdpOptions options = FsdpOptions::from(config);
    options.model_parallel = model_parallel;
    return std::make_unique<FullyShardedDataParallel>(std::move(module), group, options);
  }
  DataParallelOptions options = DataParallelOptions::from(config);
  options.model_parallel = model_parallel;
  return std::make_unique<DataParallel>(std::move(module), group, control, options);
}

}  // namespace loom::parallel
