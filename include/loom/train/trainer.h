// train::Trainer: the training loop, joining every other area.
//
//   step:  batch = reader.next()                             (data wait)
//          split into micro-batches; forward/backward each   (gradient sync overlaps backward)
//          strategy.finish_gradient_sync()                   (communication wait)
//          clip to the global norm; lr = schedule(step)
//          strategy.step()                                   (optimizer; ZeRO all-gathers)
//          metrics (metrics.jsonl, progress line), eval every N steps,
//          an async checkpoint every N steps whose copy overlaps the next step's compute.
//
// fit() first resumes from the newest committed in-memory snapshot (under `loom run`) or
// checkpoint in <run_dir>/ckpt, whichever is newer (model, optimizer shards, reader position,
// RNG, step), at the same or another world size, so a job restarted by `loom run` continues
// where it stopped. SIGTERM (what `loom run` sends to stop a job)
// finishes the current step, saves, and returns. docs/training.md.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "loom/config.h"
#include "loom/train/schedule.h"
#include "loom/visibility.h"

namespace loom {
class Runtime;
namespace data {
class BatchSource;
struct Batch;
}  // namespace data
namespace parallel {
class Strategy;
}
}  // namespace loom

namespace loom::train {

// What to do when the global gradient norm is not finite.
enum class NonFinite {
  kStop,  // raise loom::Error naming the step and the first parameter with a non-finite gradient
  kSkip,  // skip the optimizer step (no update), count it, log a warning, go on
};

// Dynamic loss scaling, for fp16 parameters (whose small gradients underflow without it), as
// torch.cuda.amp.GradScaler does it: each micro-batch's loss is multiplied by the scale before
// backward and the reduced gradients divided by it before clipping. A step whose gradient norm
// is not finite (an overflow) is skipped, whatever on_non_finite says, and the scale multiplied
// by `backoff`; after `growth_interval` steps in a row without overflow it is multiplied by
// `growth`. The scale and that count are checkpointed (the "trainer" blob). Powers of two keep
// scaling and unscaling exact, so without overflow the step equals an unscaled one bitwise.
struct LossScaling {
  bool enabled = false;
  double init_scale = 65536.0;  // 2^16, GradScaler's default
  double growth = 2.0;
  double backoff = 0.5;
  int64_t growth_interval = 2000;
};

struct LOOM_API TrainOptions {
  int64_t steps = 1000;       // optimizer steps of the whole run (a resumed run counts on)
  int64_t micro_batches = 1;  // gradient accumulation: each rank's batch is split in this many
  double grad_clip = 1.0;     // max global gradient norm; 0 = no clipping (the norm is logged)
  // The learning rate at each step; the Trainer sets it on the optimizer before every step.
  // Unset: the optimizer's own rate, constant. Set, with a peak that differs from the
  // optimizer's rate: a warning naming both (the schedule wins). docs/training.md.
  std::optional<Schedule> schedule;
  int64_t eval_every = 0;        // Callbacks::on_eval every this many steps; 0 = never
  int64_t checkpoint_every = 0;  // async checkpoint every this many steps; 0 = only at the end
  int keep_last = 3;             // committed checkpoints kept (plus none kept by step)
  // In-memory snapshots (docs/checkpoint.md): every this many steps the whole training state is
  // also saved into the node's memory that the `loom run` agent holds (Topology::snapshot_dir),
  // as a checkpoint of one step kept; a restart resumes from the newest snapshot that every
  // rank sees when it is at least as new as the newest checkpoint. A snapshot due while the
  // previous one is still being written on some rank is skipped, never waited for. 0: none;
  // without a snapshot directory (not under `loom run`): none.
  int64_t snapshot_every = 1;
  bool overlap_checkpoint_copy = true;  // copy the state during the next step's compute
  // With overlap_checkpoint_copy, where the copy of CPU tensors runs (CUDA tensors copy on a side
  // stream either way). kBackground: on the Checkpointer's copy thread during the next step's
  // data loading, forward and backward; the optimizer step waits only for what is left
  // (ckpt::SaveOptions::background_copy). kAtOptimizerStep: all of it just before the optimizer
  // step, over torch's threads. kAuto: in the background when the node has a core that no
  // rank's compute uses (local ranks x torch threads < cores), else at the optimizer step: on a
  // node whose cores all compute, a copy thread slows every step more than the copy stalls one
  // (docs/training.md).
  enum class CopyPlace { kAuto, kBackground, kAtOptimizerStep };
  CopyPlace checkpoint_copy = CopyPlace::kAuto;
  NonFinite on_non_finite = NonFinite::kStop;
  LossScaling loss_scaling;    // off by default; for fp16 parameters
  int64_t log_every = 10;      // a metrics log line every this many steps (without a TTY)
  double flops_per_token = 0;  // the model's training FLOPs per token, for MFU; 0 = no MFU
  // Steps traced to <run_dir>/traces/rank_<r>.json (metrics.trace_steps, e.g. "10-12";
  // metrics::parse_trace_steps): phases, forward and backward, collectives, checkpoint work.
  // `loom trace RUN_DIR` merges the ranks. Empty: none. Ranks must be processes (trace.h).
  std::vector<int64_t> trace_steps;
  bool resume = true;  // resume from the newest committed checkpoint
  // Resuming, a checkpoint tensor or blob the model, optimizer or trainer does not have (a
  // layer removed since the save) is an error naming it; false loads the rest and warns
  // with the list of what was dropped (PyTorch's strict=False).
  bool resume_strict = true;
  // When there is no checkpoint to resume from: a checkpoint directory whose newest committed
  // step's "model/..." tensors become the model's weights (strictly: every parameter, nothing
  // else of the model's), e.g. one made by `loom ckpt import` from PyTorch weights. The
  // optimizer, the step count and the data start fresh. Empty: the module's own weights.
  std::string init_from;
  std::chrono::milliseconds checkpoint_timeout{std::chrono::minutes(10)};

  // The train.* configuration keys (train.steps, train.lr, ...), with their defaults and help.
  static ConfigSchema schema();
  // Reads them from a config built with schema(); bad values are ConfigError naming the key.
  // train.lr left at its default with train.schedule = constant leaves `schedule` unset, so
  // that the optimizer's rate is used; any other combination builds the schedule.
  static TrainOptions from(const Config& config);
};

// One micro-batch's contribution: the mean loss over its samples (the trainer averages the
// micro-batches), and how many tokens and samples it trained on (for throughput and MFU).
struct MicroStep {
  at::Tensor loss;
  int64_t tokens = 0;
  int64_t samples = 0;
};

// The model's forward pass and loss on a micro-batch. Runs on the training thread.
using LossFn = std::function<MicroStep(const data::Batch& micro_batch)>;

// For models that run their own micro-batches: a pipeline (parallel::Pipeline) takes this
// rank's whole batch, cuts it into its micro-batches and runs forwards and backwards in its
// schedule's order. `forward_backward` does that and returns the batch's mean loss (detached;
// the same on every rank of a pipeline), tokens and samples. The Trainer runs it with the
// strategy's sync off, then strategy.reduce_accumulated_gradients(); clipping, the optimizer,
// metrics and checkpoints are as with a LossFn. train.micro_batches must be 1 (the pipeline's
// own count applies) and loss scaling off. docs/parallel.md, "The Trainer over a mesh".
struct BatchStep {
  std::function<MicroStep(const data::Batch& batch)> forward_backward;
};

// What on_step_end sees.
struct StepInfo {
  int64_t step = 0;       // 0-based index of the step just finished
  double loss = 0;        // the mean over every rank's micro-batches
  double local_loss = 0;  // this rank's mean (bitwise reproducible on this rank)
  double lr = 0;
  double grad_norm = 0;   // before clipping (after unscaling)
  bool skipped = false;   // not applied: the gradient norm was not finite (kSkip, or an overflow)
  double loss_scale = 1;  // the scale this step's backward used (1 without loss scaling)
};

struct Callbacks {
  // Once fit() has resumed (or found nothing to resume), before the first step: `step` is the
  // next step's index (0 for a fresh run). Every rank calls it.
  std::function<void(int64_t step)> on_start;
  std::function<void(int64_t step)> on_eval;              // after step `step` (every rank calls it)
  std::function<void(const StepInfo& info)> on_step_end;  // after every step
};

struct FitResult {
  int64_t start_step = 0;          // where this run began (> 0 when it resumed)
  int64_t steps_done = 0;          // steps completed in total (the next step's index)
  int64_t skipped_steps = 0;       // in this run: NonFinite::kSkip and loss-scale overflows
  bool stopped_by_signal = false;  // SIGTERM/SIGINT: the step finished and a checkpoint was saved
  double last_loss = 0;
};

// Not copyable. Every rank builds one with the same options and calls fit(). The Runtime, the
// strategy (DataParallel or FullyShardedDataParallel, parallel/strategy.h) and the batch source (a
// data::Reader or data::Mixture) must outlive it. fit() uses rt.store() (checkpoint agreement) and
// rt.control_group() (the per-step loss and stop flag, CPU tensors); it sends nothing to
// rt.world_group() itself: only the strategy's gradients and parameters travel there.
class LOOM_API Trainer {
 public:
  Trainer(Runtime& rt, parallel::Strategy& strategy, data::BatchSource& reader,
          TrainOptions options, LossFn loss, Callbacks callbacks = {});
  // The same, with the model's own micro-batch schedule (a pipeline). InvalidArgument when
  // options.micro_batches is not 1 or loss scaling is on.
  Trainer(Runtime& rt, parallel::Strategy& strategy, data::BatchSource& reader,
          TrainOptions options, BatchStep step, Callbacks callbacks = {});
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // Resumes if a checkpoint exists, trains up to options.steps, saves the final step, returns.
  // Errors: the areas' own (Timeout from a stuck collective, CorruptData from a bad shard or
  // checkpoint, IoError from a failed save), and loom::Error for a non-finite gradient under
  // NonFinite::kStop.
  FitResult fit();

 private:
  struct LOOM_HIDDEN Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace loom::train
