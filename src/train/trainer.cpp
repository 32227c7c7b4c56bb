// The training loop: resume, step, checkpoint, stop.
#include "loom/train/trainer.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/module.h>

#include <atomic>
#include <cmath>
#include <csignal>
#include <limits>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>

#include "loom/ckpt/checkpointer.h"
#include "loom/ckpt/export.h"
#include "loom/comm/group.h"
#include "loom/data/reader.h"
#include "loom/error.h"
#include "loom/metrics/flops.h"
#include "loom/metrics/logger.h"
#include "loom/parallel/optim.h"
#include "loom/parallel/strategy.h"
#include "loom/runtime.h"

namespace loom::train {
namespace {

using metrics::Phase;
using nlohmann::json;

std::atomic<int> g_stop_signal{0};
void on_stop_signal(int sig) { g_stop_signal.store(sig); }

// Installs the stop handlers for fit()'s duration and restores the previous ones.
class StopSignals {
 public:
  StopSignals() {
    g_stop_signal.store(0);
    struct sigaction action {};
    action.sa_handler = on_stop_signal;
    ::sigaction(SIGTERM, &action, &old_term_);
    ::sigaction(SIGINT, &action, &old_int_);
  }
  ~StopSignals() {
    ::sigaction(SIGTERM, &old_term_, nullptr);
    ::sigaction(SIGINT, &old_int_, nullptr);
  }

 private:
  struct sigaction old_term_ {};
  struct sigaction old_int_ {};
};

// Micro-batch m of M: rows [m * B / M, (m + 1) * B / M) of every tensor and string list.
data::Batch micro_batch(const data::Batch& batch, int64_t m, int64_t count) {
  if (count == 1) return batch;
  const int64_t rows = static_cast<int64_t>(batch.indices.size());
  const int64_t begin = m * rows / count, end = (m + 1) * rows / count;
  data::Batch out;
  for (const auto& [name, t] : batch.tensors) out.tensors[name] = t.slice(0, begin, end);
  for (const auto& [name, list] : batch.strings)
    out.strings[name] = {list.begin() + begin, list.begin() + end};
  out.indices = {batch.indices.begin() + begin, batch.indices.begin() + end};
  out.num_real = std::clamp<int64_t>(batch.num_real - begin, 0, end - begin);
  out.epoch = batch.epoch;
  return out;
}

}  // namespace

ConfigSchema TrainOptions::schema() {
  ConfigSchema s;
  s.add("train.steps", int64_t{1000}, "optimizer steps of the whole run");
  s.add("train.micro_batches", int64_t{1}, "gradient accumulation: micro-batches per step");
  s.add("train.grad_clip", 1.0, "max global gradient norm; 0 = no clipping");
  s.add("train.lr", 1e-3,
        "peak learning rate; unset with the constant schedule: the optimizer's own rate");
  s.add("train.min_lr", 0.0, "learning rate at the end of the cosine decay");
  s.add("train.warmup_steps", int64_t{0}, "linear warmup steps");
  s.add("train.schedule", "constant", "constant or cosine (linear warmup + cosine decay)");
  s.add("train.eval_every", int64_t{0}, "steps between evaluations; 0 = never");
  s.add("train.checkpoint_every", int64_t{0},
        "steps between async checkpoints; 0 = only at the end");
  s.add("train.keep_last", 3, "committed checkpoints kept");
  s.add("train.on_non_finite", "stop", "stop (error naming the parameter) or skip the step");
  s.add("train.log_every", int64_t{10}, "steps between metrics log lines (without a terminal)");
  s.add("train.resume", true, "resume from the newest committed checkpoint in <run.dir>/ckpt");
  s.add("train.resume_strict", true,
        "resuming, a saved tensor or blob the model does not have is an error (false: warn)");
  s.add("train.loss_scaling", false,
        "dynamic loss scaling (for fp16 parameters): skip and halve on overflow");
  s.add("train.loss_scale", 65536.0, "initial loss scale (with train.loss_scaling)");
  s.add("train.loss_scale_growth_interval", int64_t{2000},
        "steps without overflow before the loss scale doubles");
  s.add("train.init_from", "",
        "with nothing to resume: a checkpoint directory (e.g. from `loom ckpt import`) whose "
        "newest step's model weights start the run");
  return s;
}

TrainOptions TrainOptions::from(const Config& c) {
  TrainOptions o;
  o.steps = c.get<int64_t>("train.steps");
  o.micro_batches = c.get<int64_t>("train.micro_batches");
  o.grad_clip = c.get<double>("train.grad_clip");
  const auto schedule = c.get<std::string>("train.schedule");
  LOOM_CHECK(schedule == "constant" || schedule == "cosine", ConfigError,
             "train.schedule must be constant or cosine, got '", schedule, "'");
  const bool lr_set = c.source("train.lr") != ConfigSource::kDefault;
  if (schedule == "cosine") {
    o.schedule = Schedule::warmup_cosine({.lr = c.get<double>("train.lr"),
                                          .min_lr = c.get<double>("train.min_lr"),
                                          .warmup_steps = c.get<int64_t>("train.warmup_steps"),
                                          .total_steps = o.steps});
  } else if (lr_set) {
    o.schedule = Schedule::constant(c.get<double>("train.lr"));
  }  // else unset: the optimizer's rate
  o.eval_every = c.get<int64_t>("train.eval_every");
  o.checkpoint_every = c.get<int64_t>("train.checkpoint_every");
  o.keep_last = c.get<int>("train.keep_last");
  const auto non_finite = c.get<std::string>("train.on_non_finite");
  LOOM_CHECK(non_finite == "stop" || non_finite == "skip", ConfigError,
             "train.on_non_finite must be stop or skip, got '", non_finite, "'");
  o.on_non_finite = non_finite == "stop" ? NonFinite::kStop : NonFinite::kSkip;
  o.log_every = c.get<int64_t>("train.log_every");
  o.resume = c.get<bool>("train.resume");
  o.resume_strict = c.get<bool>("train.resume_strict");
  o.loss_scaling.enabled = c.get<bool>("train.loss_scaling");
  o.loss_scaling.init_scale = c.get<double>("train.loss_scale");
  o.loss_scaling.growth_interval = c.get<int64_t>("train.loss_scale_growth_interval");
  o.init_from = c.get<std::string>("train.init_from");
  return o;
}

struct Trainer::Impl {
  // Constant after construction.
  Runtime& rt;
  parallel::Strategy& strategy;
  data::BatchSource& reader;
  TrainOptions options;
  LossFn loss_fn;
  Callbacks callbacks;

  // The training thread's.
  std::unique_ptr<ckpt::Checkpointer> checkpointer;
  std::unique_ptr<metrics::MetricsLogger> metrics;
  ckpt::State save_state;    // the last save's description (its tensors are live views)
  at::Tensor rng_buffer;     // this rank's CPU generator state, copied at each save
  ckpt::SaveHandle pending;  // the save in flight, if any
  int64_t step = 0;          // the next step's index = steps completed
  int64_t skipped = 0;
  bool stop_agreed = false;      // some rank got SIGTERM/SIGINT before the last step's all-reduce
  double loss_scale = 1;         // LossScaling: the current scale (1 without)
  int64_t scale_good_steps = 0;  // steps since the last overflow or growth

  Impl(Runtime& r, parallel::Strategy& d, data::BatchSource& rd, TrainOptions o, LossFn l,
       Callbacks c)
      : rt(r),
        strategy(d),
        reader(rd),
        options(std::move(o)),
        loss_fn(std::move(l)),
        callbacks(std::move(c)) {
    LOOM_CHECK(options.steps >= 0, InvalidArgument, "train.steps must be >= 0, got ",
               options.steps);
    LOOM_CHECK(options.micro_batches >= 1 && reader.batch_size() % options.micro_batches == 0,
               InvalidArgument, "train.micro_batches (", options.micro_batches,
               ") must divide the per-rank batch size (", reader.batch_size(), ")");
    LOOM_CHECK(loss_fn != nullptr, InvalidArgument, "the Trainer needs a loss function");
    const LossScaling& ls = options.loss_scaling;
    LOOM_CHECK(!ls.enabled || (ls.init_scale > 0 && ls.growth >= 1 && ls.backoff > 0 &&
                               ls.backoff < 1 && ls.growth_interval >= 1),
               InvalidArgument,
               "loss scaling needs init_scale > 0, growth >= 1, 0 < backoff < 1 "
               "and growth_interval >= 1; got ",
               ls.init_scale, ", ", ls.growth, ", ", ls.backoff, ", ", ls.growth_interval);
    loss_scale = ls.enabled ? ls.init_scale : 1.0;
  }

  void open_checkpointer() {
    checkpointer = std::make_unique<ckpt::Checkpointer>(
        rt.store(), ckpt::CheckpointerOptions{.dir = rt.run_dir() / "ckpt",
                                              .rank = rt.rank(),
                                              .world_size = rt.world_size(),
                                              .keep_last = options.keep_last,
                                              .timeout = options.checkpoint_timeout});
    rng_buffer = at::detail::getDefaultCPUGenerator().get_state().clone();
  }

  // Unset: the optimizer's rate, constant. Set and differing from it: say so, naming both,
  // since the schedule replaces the optimizer's rate at every step.
  void resolve_schedule() {
    const double optimizer_lr = strategy.optimizer().lr();
    if (!options.schedule) {
      options.schedule = Schedule::constant(optimizer_lr);
    } else if (options.schedule->peak() != optimizer_lr) {
      rt.log().warn(
          "the learning-rate schedule {} (train.lr = {}) differs from the optimizer's learning "
          "rate {}: the schedule sets the rate at every step, so {} is not used. Leave train.lr "
          "unset to train at the optimizer's rate, or make them agree",
          options.schedule->describe(), options.schedule->peak(), optimizer_lr, optimizer_lr);
    }
  }

  // What a checkpoint holds, as views of the live state. Built anew for every save: the
  // strategy's "optim" blob (the optimizer's step count) changes every step.
  ckpt::State describe_state() {
    ckpt::State state;
    strategy.add_state(state);
    state.add(
        "rng/cpu", rng_buffer.view({1, -1}),
        ckpt::Sharding::rows({rt.world_size(), rng_buffer.numel()}, rt.rank(), rt.rank() + 1));
    json trainer{{"step", step}, {"skipped_steps", skipped}};
    trainer["loss_scale"] = loss_scale;
    trainer["loss_scale_good_steps"] = scale_good_steps;
    state.blobs["trainer"] = trainer.dump();
    state.blobs["reader"] = reader.state_json();
    state.blobs["config"] = json(rt.config().to_toml()).dump();
    return state;
  }

  // Resumes from the newest committed checkpoint; returns whether there was one.
  bool resume() {
    const auto steps = checkpointer->list();
    if (!options.resume || steps.empty()) return false;
    const ckpt::CheckpointInfo& newest = steps.back();
    ckpt::State state;
    strategy.add_state(state);
    const bool same_world = newest.world_size == rt.world_size();
    at::Tensor rng = at::empty_like(rng_buffer);
    if (same_world) {
      state.add("rng/cpu", rng.view({1, -1}),
                ckpt::Sharding::rows({rt.world_size(), rng.numel()}, rt.rank(), rt.rank() + 1));
    }
    state.blobs["trainer"] = "";
    state.blobs["reader"] = "";
    // Left out knowingly: the saved config (the run's own config governs), and at another
    // world size the per-rank RNG streams, which have no meaning there.
    ckpt::LoadOptions load{.strict = options.resume_strict, .leave_out = {"config"}};
    if (!same_world) load.leave_out.push_back("rng/cpu");
    const int64_t loaded = checkpointer->load(newest.step, state, load);
    strategy.load_state(state);
    const json trainer = json::parse(state.blobs.at("trainer"));
    step = trainer.at("step").get<int64_t>();
    if (options.loss_scaling.enabled && trainer.contains("loss_scale")) {
      loss_scale = trainer.at("loss_scale").get<double>();
      scale_good_steps = trainer.at("loss_scale_good_steps").get<int64_t>();
    }
    reader.restore_json(state.blobs.at("reader"));
    if (same_world) {
      at::Generator generator = at::detail::getDefaultCPUGenerator();  // a handle to the global one
      std::lock_guard<std::mutex> lock(generator.mutex());
      generator.set_state(rng);
    } else {
      rt.log().warn(
          "resuming at world size {} from a checkpoint saved at {}: per-rank RNG streams restart "
          "from the seed",
          rt.world_size(), newest.world_size);
    }
    rt.log().info("resumed from checkpoint step {} ({}): continuing at step {}", loaded,
                  newest.path.string(), step);
    return true;
  }

  // train.init_from: the model's weights from the newest committed step there, loaded on every
  // rank (each reads the same file), then the masters re-derived. Strict about the model.
  void init_weights() {
    const int64_t loaded = strategy.load_weights(options.init_from, ckpt::Checkpointer::kLatest);
    rt.log().info(
        "initialised the model's weights from {} (step {}); optimizer and data start "
        "fresh",
        options.init_from, loaded);
  }

  // Waits for the save in flight, if any, and reports it committed; raises its error.
  void finish_pending() {
    if (!pending.valid()) return;
    pending.wait(options.checkpoint_timeout);
    metrics->on_checkpoint_committed(pending.step());
    pending = {};
  }

  void save(bool sync) {
    finish_pending();
    rng_buffer.copy_(at::detail::getDefaultCPUGenerator().get_state());
    save_state = describe_state();
    if (sync) {
      checkpointer->save_sync(step, save_state);
      metrics->on_checkpoint_committed(step);
    } else {
      pending =
          checkpointer->save(step, save_state, {.defer_copy = options.overlap_checkpoint_copy});
    }
  }

  // Reports the save in flight once it has finished; raises its error. Never blocks.
  void poll_pending() {
    if (pending.valid() && pending.done()) finish_pending();
  }

  std::string first_non_finite_parameter() const {
    const std::string name = strategy.first_non_finite_gradient();
    return name.empty() ? "(none on this rank)" : name;
  }

  // LossScaling after a step's norm: an overflow skips the step and backs the scale off; a run
  // of good steps grows it. Every rank sees the same (all-reduced) norm, so all agree.
  void update_loss_scale(StepInfo& info) {
    const LossScaling& ls = options.loss_scaling;
    if (!std::isfinite(info.grad_norm)) {
      info.skipped = true;
      ++skipped;
      loss_scale *= ls.backoff;
      scale_good_steps = 0;
      rt.log().warn("step {}: gradients overflowed at loss scale {}; step skipped, scale now {}",
                    step, info.loss_scale, loss_scale);
      return;
    }
    if (++scale_good_steps >= ls.growth_interval) {
      loss_scale *= ls.growth;
      scale_good_steps = 0;
    }
  }

  // One step; returns what on_step_end sees.
  StepInfo run_step() {
    metrics::StepTimer& timer = metrics->timer();
    timer.begin_step();
    StepInfo info;
    info.step = step;
    data::Batch batch;
    {
      auto phase = timer.phase(Phase::kDataWait);
      batch = reader.next();
    }
    at::Tensor loss_sum;  // this rank's micro-batch losses, summed in double on their device
    int64_t tokens = 0, samples = 0;
    strategy.zero_grad();
    {
      auto phase = timer.phase(Phase::kForwardBackward);
      for (int64_t m = 0; m < options.micro_batches; ++m) {
        strategy.set_sync(m + 1 == options.micro_batches);
        MicroStep micro = loss_fn(micro_batch(batch, m, options.micro_batches));
        if (options.loss_scaling.enabled) {
          (micro.loss * (loss_scale / static_cast<double>(options.micro_batches))).backward();
        } else {
          (micro.loss / static_cast<double>(options.micro_batches)).backward();
        }
        const at::Tensor loss = micro.loss.detach().to(at::kDouble);
        loss_sum = loss_sum.defined() ? loss_sum + loss : loss;
        tokens += micro.tokens;
        samples += micro.samples;
      }
    }
    {
      auto phase = timer.phase(Phase::kCommWait);
      strategy.finish_gradient_sync();
    }
    info.loss_scale = loss_scale;
    {
      auto phase = timer.phase(Phase::kOptimizer);
      if (options.loss_scaling.enabled) strategy.scale_gradients(1.0 / loss_scale);
      info.grad_norm = strategy.clip_grad_norm(
          options.grad_clip > 0 ? options.grad_clip : std::numeric_limits<double>::infinity());
      info.lr = (*options.schedule)(step);
    }
    // The loss's one host read of the step, after the norm's: on a GPU the device has then run
    // backward already, so the read costs a copy, not a wait.
    info.local_loss = loss_sum.item<double>() / static_cast<double>(options.micro_batches);
    if (options.loss_scaling.enabled) {
      update_loss_scale(info);
    } else if (!std::isfinite(info.grad_norm)) {
      LOOM_CHECK(options.on_non_finite == NonFinite::kSkip, Error, "step ", step,
                 ": the gradient norm is ", info.grad_norm, "; first non-finite gradient on rank ",
                 rt.rank(), ": ", first_non_finite_parameter(),
                 ". Lower the learning rate, check the data, or set train.on_non_finite=skip");
      info.skipped = true;
      ++skipped;
      rt.log().warn("step {}: gradient norm {}; step skipped ({} so far)", step, info.grad_norm,
                    skipped);
    }
    if (pending.valid()) {
      auto phase = timer.phase(Phase::kCheckpointStall);
      checkpointer->before_optimizer_step();  // the deferred snapshot, before parameters change
    }
    if (!info.skipped) {
      auto phase = timer.phase(Phase::kOptimizer);
      strategy.optimizer().set_lr(info.lr);
      strategy.step();
    }
    // One small all-reduce on the control group (host scalars, never the tensor group): the
    // loss sum, and whether any rank was asked to stop (so every rank stops after the same step).
    at::Tensor sums =
        at::tensor({info.local_loss, g_stop_signal.load() != 0 ? 1.0 : 0.0}, at::kDouble);
    rt.control_group().all_reduce(sums)->wait();
    info.loss = sums[0].item<double>() / rt.world_size();
    stop_agreed = sums[1].item<double>() > 0;
    const metrics::StepMetrics logged =
        metrics->log_step({.step = step,
                           .epoch = static_cast<int64_t>(batch.epoch),
                           .loss = info.loss,
                           .lr = info.lr,
                           .grad_norm = info.grad_norm,
                           .tokens = tokens,
                           .samples = samples});
    rt.report_progress(
        step, tokens > 0 ? logged.tokens_per_second_smoothed : logged.samples_per_second_smoothed);
    return info;
  }

  FitResult fit() {
    StopSignals signals;
    metrics = std::make_unique<metrics::MetricsLogger>(
        rt, metrics::MetricsOptions{.flops_per_token = options.flops_per_token,
                                    .peak = options.flops_per_token > 0
                                                ? metrics::peak_flops(rt.device())
                                                : metrics::PeakFlops{},
                                    .log_every = options.log_every});
    resolve_schedule();
    open_checkpointer();
    FitResult result;
    if (!resume() && !options.init_from.empty()) init_weights();
    result.start_step = step;
    metrics->on_resume(step);
    while (step < options.steps) {
      const StepInfo info = run_step();
      ++step;
      result.last_loss = info.loss;
      if (callbacks.on_step_end) callbacks.on_step_end(info);
      poll_pending();
      if (options.checkpoint_every > 0 && step % options.checkpoint_every == 0 &&
          step < options.steps) {
        save(false);
      }
      if (options.eval_every > 0 && step % options.eval_every == 0 && callbacks.on_eval) {
        metrics->clear_progress_line();
        callbacks.on_eval(step - 1);
      }
      if (stop_agreed) {
        result.stopped_by_signal = true;
        rt.log().info("stop requested (signal {}): saving step {} and stopping",
                      g_stop_signal.load(), step);
        break;
      }
    }
    metrics->clear_progress_line();
    // The save in flight first: it may already be this very step (a stop right after a save).
    finish_pending();
    const std::optional<int64_t> latest = checkpointer->latest();
    if (!latest || *latest != step) save(true);
    result.steps_done = step;
    result.skipped_steps = skipped;
    return result;
  }
};

Trainer::Trainer(Runtime& rt, parallel::Strategy& strategy, data::BatchSource& reader,
                 TrainOptions options, LossFn loss, Callbacks callbacks)
    : impl_(std::make_unique<Impl>(rt, strategy, reader, std::move(options), std::move(loss),
                                   std::move(callbacks))) {}

Trainer::~Trainer() = default;

FitResult Trainer::fit() { return impl_->fit(); }

}  // namespace loom::train
