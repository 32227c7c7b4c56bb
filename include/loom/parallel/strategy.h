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
                                                 const Config& config);

}  // namespace loom::parallel
