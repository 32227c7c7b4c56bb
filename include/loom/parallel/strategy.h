// parallel::Strategy: how the model's training state is spread over the data-parallel ranks,
// as the Trainer drives it. DataParallel (DDP, ZeRO-1, ZeRO-2) and FullyShardedDataParallel
// (FSDP, ZeRO-3) implement it; make_strategy builds the one parallel.mode names.
//
//   loom::parallel::wrap_modules<BlockImpl>(model->blocks);  // FSDP units (ignored by the others)
//   auto strategy = loom::parallel::make_strategy(model.ptr(), rt.world_group(),
//                                                 rt.control_group(), cfg);
//   strategy->set_optimizer(std::make_unique<loom::optim::AdamW>(...));
//   loom::train::Trainer trainer(rt, *strategy, reader, options, loss_fn);
//
// One step, as the Trainer runs it: zero_grad; for each micro-batch set_sync(last) and
// backward; finish_gradient_sync; [scale_gradients]; clip_grad_norm; step. Every call but
// module() and first_non_finite_gradient() may be collective (see each class): every rank makes
// the same calls in the same order. Thread safety: one thread at a time.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "loom/comm/group.h"
#include "loom/config.h"
#include "loom/optim/flat_optimizer.h"
#include "loom/visibility.h"

namespace torch::nn {
class Module;
}
namespace loom::ckpt {
struct State;
}

namespace loom::parallel {

// Model parallelism around a data-parallel strategy: its module's parameters are this rank's
// pieces of a model split by tensor parallelism over `tp` (tp::shard_spec says how each is
// split) and into pipeline stages over `pp` (the module holds only this stage's parameters,
// under the whole model's names). Given to DataParallelOptions / FsdpOptions, it makes
//   - checkpoints describe each parameter (and its optimizer state) as its piece of the whole
//     model's tensor (tp::checkpoint_piece), written by one rank of the model-parallel ranks
//     holding it, so that a checkpoint loads under any (pp, dp, tp) layout and without model
//     parallelism at all;
//   - clip_grad_norm the whole model's norm: sharded gradients' squares summed over tp,
//     replicated ones counted once, every stage's summed over pp;
//   - reduce_accumulated_gradients first sum the gradients of `tied` parameters over their
//     group (a token embedding used on the first and the last stage).
// docs/parallel.md, "The Trainer over a mesh". All groups must outlive the strategy.
struct ModelParallel {
  comm::Group* tp = nullptr;  // null or one rank: no tensor parallelism
  comm::Group* pp = nullptr;  // null or one rank: no pipeline
  struct Tied {
    std::string name;    // the parameter, as the module names it
    comm::Group* group;  // the ranks holding it (this one included); its rank 0 counts it
  };
  std::vector<Tied> tied;

  // Whether any of it applies: a tp or pp group of more than one rank, or a tied parameter.
  bool active() const {
    return (tp != nullptr && tp->size() > 1) || (pp != nullptr && pp->size() > 1) || !tied.empty();
  }
};

class LOOM_API Strategy {
 public:
  virtual ~Strategy() = default;

  virtual torch::nn::Module& module() const = 0;
  virtual void set_optimizer(std::unique_ptr<optim::FlatOptimizer> optimizer) = 0;
  virtual optim::FlatOptimizer& optimizer() const = 0;

  // false: the next backward only accumulates gradients (a micro-step of accumulation).
  virtual void set_sync(bool sync) = 0;
  virtual void zero_grad() = 0;
  // Waits for the gradient reductions of the last synced backward.
  virtual void finish_gradient_sync() = 0;
  // For models that run their own micro-batches (a pipeline schedule): after backwards run
  // without sync, sums tied parameters' gradients over their groups (ModelParallel::tied) and
  // starts the reduction of every accumulated gradient over the data-parallel ranks, as a
  // synced backward would have; finish_gradient_sync then waits for it. Collective.
  virtual void reduce_accumulated_gradients() = 0;
  // Multiplies the reduced gradients by factor (unscaling after loss scaling); no host read.
  virtual void scale_gradients(double factor) = 0;
  // torch::nn::utils::clip_grad_norm_'s formula over every rank's gradients; returns the norm
  // before clipping (infinity: no clipping, the norm only).
  virtual double clip_grad_norm(double max_norm) = 0;
  virtual void step() = 0;

  // Views of this rank's state with names and element ranges that do not depend on the
  // strategy or the world size ("model/<param>", "optim/<param>/<state>"), and the "optim"
  // blob; a checkpoint saved under one strategy loads under any other (docs/parallel.md).
  virtual void add_state(ckpt::State& state) = 0;
  virtual void load_state(const ckpt::State& state) = 0;
  // Sets the model's weights from the "model/" tensors of `step` of a checkpoint directory
  // (ckpt::Checkpointer::kLatest: the newest) on every rank, strictly (ckpt::load_model_weights),
  // and re-derives the master weights; the optimizer state is left as it is. Returns the step.
  virtual int64_t load_weights(const std::filesystem::path& ckpt_dir, int64_t step) = 0;

  // The first parameter whose reduced gradient has a NaN or Inf in the part this rank holds;
  // empty when none. Reads gradients back to the host: for error messages only.
  virtual std::string first_non_finite_gradient() const = 0;
};

enum class Mode { kDdp, kZero1, kZero2, kFsdp };

LOOM_API const char* to_string(Mode mode);

// The parallel.* config keys of every strategy: parallel.mode (ddp, zero1, zero2, fsdp), those
// of DataParallelOptions::schema() and of FsdpOptions::schema().
LOOM_API ConfigSchema strategy_schema();
// parallel.mode; ConfigError naming the key and the choices for anything else.
LOOM_API Mode mode_from(const Config& config);

// Collective (each strategy's construction is). The DataParallel for ddp/zero1/zero2, the
// FullyShardedDataParallel for fsdp, whose units are the FsdpUnits already in `module` (wrap
// them before; without any, the whole model is one unit). Both groups must outlive the
// strategy; `control` carries DataParallel's construction checks (FSDP sends everything over
// `group`).
LOOM_API std::unique_ptr<Strategy> make_strategy(std::shared_ptr<torch::nn::Module> module,
                                                 comm::Group& group, comm::Group& control,
                                                 const Config& config,
                                                 const ModelParallel& model_parallel = {});

}  // namespace loom::parallel
