// The training loop: resume, step, checkpoint, stop.
#include "loom/train/trainer.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <csignal>
#include <limits>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <thread>

#include "ckpt/manifest.h"
#include "comm/group_internal.h"
#include "loom/ckpt/checkpointer.h"
#include "loom/ckpt/export.h"
#include "loom/comm/group.h"
#include "loom/data/reader.h"
#include "loom/error.h"
#include "loom/metrics/flops.h"
#include "loom/metrics/logger.h"
#include "loom/metrics/trace.h"
#include "loom/optim/flat_optimizer.h"
#include "loom/parallel/strategy.h"
#include "loom/runtime.h"
#include "util/json.h"

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
  const TrainOptions d;  // the defaults, stated once (trainer.h)
  ConfigSchema s;
  s.add("train.steps", d.steps, "optimizer steps of the whole run");
  s.add("train.micro_batches", d.micro_batches, "gradient accumulation: micro-batches per step");
  s.add("train.grad_clip", d.grad_clip, "max global gradient norm; 0 = no clipping");
  s.add("train.lr", 1e-3,
        "peak learning rate; unset with the constant schedule: the optimizer's own rate");
  s.add("train.min_lr", 0.0, "learning rate at the end of the cosine decay");
  s.add("train.warmup_steps", int64_t{0}, "linear warmup steps");
  s.add("train.schedule", "constant", "constant or cosine (linear warmup + cosine decay)");
  s.add("train.eval_every", d.eval_every, "steps between evaluations; 0 = never");
  s.add("train.checkpoint_every", d.checkpoint_every,
        "steps between async checkpoints; 0 = only at the end");
  s.add("train.keep_last", d.keep_last, "committed checkpoints kept");
  s.add("train.snapshot_every", d.snapshot_every,
        "steps between in-memory snapshots under `loom run` (skipped while one is still being "
        "written); 0 = none");
  s.add("train.checkpoint_copy", "auto",
        "where a checkpoint's or snapshot's copy of CPU tensors runs: background (a thread of "
        "its own during the next forward and backward), optimizer_step (all of it just before "
        "the optimizer step) or auto (background when a core is left over by the ranks' compute)");
  s.add("train.on_non_finite", "stop", "stop (error naming the parameter) or skip the step");
  s.add("train.log_every", d.log_every, "steps between metrics log lines (without a terminal)");
  s.add("metrics.trace_steps", "",
        "steps to trace into <run.dir>/traces (e.g. \"10-12\" or \"5,20\"; 0-based); "
        "`loom trace RUN_DIR` merges the ranks for Perfetto");
  s.add("train.resume", d.resume, "resume from the newest committed checkpoint in <run.dir>/ckpt");
  s.add("train.resume_strict", d.resume_strict,
        "resuming, a saved tensor or blob the model does not have is an error (false: warn)");
  s.add("train.loss_scaling", d.loss_scaling.enabled,
        "dynamic loss scaling (for fp16 parameters): skip and halve on overflow");
  s.add("train.loss_scale", d.loss_scaling.init_scale,
        "initial loss scale (with train.loss_scaling)");
  s.add("train.loss_scale_growth_interval", d.loss_scaling.growth_interval,
        "steps without overflow before the loss scale doubles");
  s.add("train.init_from", d.init_from,
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
  o.snapshot_every = c.get<int64_t>("train.snapshot_every");
  const auto copy = c.get<std::string>("train.checkpoint_copy");
  LOOM_CHECK(copy == "auto" || copy == "background" || copy == "optimizer_step", ConfigError,
             "train.checkpoint_copy must be auto, background or optimizer_step, got '", copy, "'");
  o.checkpoint_copy = copy == "background"       ? TrainOptions::CopyPlace::kBackground
                      : copy == "optimizer_step" ? TrainOptions::CopyPlace::kAtOptimizerStep
                                                 : TrainOptions::CopyPlace::kAuto;
  const auto non_finite = c.get<std::string>("train.on_non_finite");
  LOOM_CHECK(non_finite == "stop" || non_finite == "skip", ConfigError,
             "train.on_non_finite must be stop or skip, got '", non_finite, "'");
  o.on_non_finite = non_finite == "stop" ? NonFinite::kStop : NonFinite::kSkip;
  o.log_every = c.get<int64_t>("train.log_every");
  o.trace_steps = metrics::parse_trace_steps(c.get<std::string>("metrics.trace_steps"));
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
  BatchStep batch_step;  // instead of loss_fn: the model schedules its own micro-batches
  Callbacks callbacks;

  // A series of saves: the checkpoints on disk (<run_dir>/ckpt), or the snapshots in the node's
  // memory (Topology::snapshot_dir, tmpfs the `loom run` agent holds for the job).
  struct Series {
    const char* what;                                  // "checkpoint" or "snapshot", for the log
    std::unique_ptr<ckpt::Checkpointer> checkpointer;  // null: this series is off
    ckpt::State state;         // the last save's description (its tensors are live views)
    at::Tensor rng;            // this rank's CPU generator state, copied at each save
    ckpt::SaveHandle pending;  // the save in flight, if any
  };

  // The training thread's.
  Series disk{"checkpoint"};
  Series snapshots{"snapshot"};
  bool snapshot_busy = false;   // some rank's last snapshot was still being written (all agree)
  bool background_copy = true;  // TrainOptions::checkpoint_copy, resolved by fit()
  std::unique_ptr<metrics::MetricsLogger> metrics;
  int64_t step = 0;  // the next step's index = steps completed
  int64_t skipped = 0;
  bool stop_agreed = false;      // some rank got SIGTERM/SIGINT before the last step's all-reduce
  double loss_scale = 1;         // LossScaling: the current scale (1 without)
  int64_t scale_good_steps = 0;  // steps since the last overflow or growth

  Impl(Runtime& r, parallel::Strategy& d, data::BatchSource& rd, TrainOptions o, LossFn l,
       BatchStep b, Callbacks c)
      : rt(r),
        strategy(d),
        reader(rd),
        options(std::move(o)),
        loss_fn(std::move(l)),
        batch_step(std::move(b)),
        callbacks(std::move(c)) {
    LOOM_CHECK(options.steps >= 0, InvalidArgument, "train.steps must be >= 0, got ",
               options.steps);
    LOOM_CHECK(options.micro_batches >= 1 && reader.batch_size() % options.micro_batches == 0,
               InvalidArgument, "train.micro_batches (", options.micro_batches,
               ") must divide the per-rank batch size (", reader.batch_size(), ")");
    LOOM_CHECK(loss_fn != nullptr || batch_step.forward_backward != nullptr, InvalidArgument,
               "the Trainer needs a loss function");
    LOOM_CHECK(loss_fn != nullptr || (options.micro_batches == 1 && !options.loss_scaling.enabled),
               InvalidArgument,
               "with a model that runs its own micro-batches (a pipeline), "
               "train.micro_batches must be 1 (it is ",
               options.micro_batches,
               ": the pipeline's micro-batch count applies) and loss scaling off");
    const LossScaling& ls = options.loss_scaling;
    LOOM_CHECK(!ls.enabled || (ls.init_scale > 0 && ls.growth >= 1 && ls.backoff > 0 &&
                               ls.backoff < 1 && ls.growth_interval >= 1),
               InvalidArgument,
               "loss scaling needs init_scale > 0, growth >= 1, 0 < backoff < 1 "
               "and growth_interval >= 1; got ",
               ls.init_scale, ", ", ls.growth, ", ", ls.backoff, ", ", ls.growth_interval);
    loss_scale = ls.enabled ? ls.init_scale : 1.0;
  }

  void open_checkpointers() {
    const at::Tensor rng = at::detail::getDefaultCPUGenerator().get_state();
    disk.checkpointer = std::make_unique<ckpt::Checkpointer>(
        rt.store(), ckpt::CheckpointerOptions{.dir = rt.run_dir() / "ckpt",
                                              .rank = rt.rank(),
                                              .world_size = rt.world_size(),
                                              .keep_last = options.keep_last,
                                              .timeout = options.checkpoint_timeout});
    disk.rng = rng.clone();
    const std::filesystem::path& memory = rt.topology().snapshot_dir;
    if (options.snapshot_every <= 0 || memory.empty()) return;
    // Files on tmpfs (O_DIRECT does not apply there). Every node's ranks write into their own
    // node's directory, rank 0 commits in its node's, and the agents copy each node's files to
    // the next node (control/snapshot_replication.h). Retention is the Trainer's, on every node
    // (drop_older_snapshots), so that the Checkpointer keeps every committed step.
    snapshots.checkpointer = std::make_unique<ckpt::Checkpointer>(
        rt.store(), ckpt::CheckpointerOptions{.dir = memory,
                                              .rank = rt.rank(),
                                              .world_size = rt.world_size(),
                                              .keep_last = 0,
                                              .timeout = options.checkpoint_timeout,
                                              .direct_io = false,
                                              .store_prefix = "snapshot"});
    snapshots.rng = rng.clone();
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

  // TrainOptions::checkpoint_copy: kAuto is the background when a core is left over by the
  // node's ranks' compute threads (measured: bench_recovery --mode=stall, docs/benchmarks.md).
  void resolve_copy_place() {
    const unsigned cores = std::thread::hardware_concurrency();
    const int64_t busy = static_cast<int64_t>(rt.local_world_size()) * at::get_num_threads();
    using Place = TrainOptions::CopyPlace;
    background_copy =
        options.checkpoint_copy == Place::kBackground ||
        (options.checkpoint_copy == Place::kAuto && busy < static_cast<int64_t>(cores));
    if (options.checkpoint_copy == Place::kAuto) {
      rt.log().info(
          "checkpoint copies {}: {} local rank(s) x {} torch thread(s) on {} core(s) "
          "(train.checkpoint_copy=auto)",
          background_copy ? "in the background" : "at the optimizer step", rt.local_world_size(),
          at::get_num_threads(), cores);
    }
  }

  // What a checkpoint holds, as views of the live state. Built anew for every save: the
  // strategy's "optim" blob (the optimizer's step count) changes every step.
  ckpt::State describe_state(const at::Tensor& rng) {
    ckpt::State state;
    strategy.add_state(state);
    state.add("rng/cpu", rng.view({1, -1}),
              ckpt::Sharding::rows({rt.world_size(), rng.numel()}, rt.rank(), rt.rank() + 1));
    json trainer{{"step", step}, {"skipped_steps", skipped}};
    trainer["loss_scale"] = loss_scale;
    trainer["loss_scale_good_steps"] = scale_good_steps;
    state.blobs["trainer"] = trainer.dump();
    state.blobs["reader"] = reader.state_json();
    state.blobs["config"] = json(rt.config().to_toml()).dump();
    return state;
  }

  // The newest committed snapshot that every rank sees whole (a node's snapshot directory
  // holds its own ranks' files and those its agent copied from the previous node), or nothing.
  // Two all-reduces on the control group: the least of the ranks' newest whole snapshots, then
  // whether every rank holds that one whole. Under `loom run` (where a node may run without
  // snapshots while another has them) or with snapshots on; every rank calls it.
  std::optional<ckpt::CheckpointInfo> agreed_newest_snapshot() {
    if (rt.topology().generation == 0 && !snapshots.checkpointer) return std::nullopt;
    std::vector<ckpt::CheckpointInfo> whole;
    if (snapshots.checkpointer) {
      for (const ckpt::CheckpointInfo& info : snapshots.checkpointer->list()) {
        if (holds_every_file(info)) whole.push_back(info);
      }
    }
    at::Tensor newest =
        at::tensor({whole.empty() ? -1.0 : static_cast<double>(whole.back().step)}, at::kDouble);
    rt.control_group().all_reduce(newest, {.op = comm::ReduceOp::kMin})->wait();
    const int64_t step = static_cast<int64_t>(newest.item<double>());
    auto it = std::find_if(whole.begin(), whole.end(),
                           [&](const ckpt::CheckpointInfo& i) { return i.step == step; });
    at::Tensor held = at::tensor({it != whole.end() ? 1.0 : 0.0}, at::kDouble);
    rt.control_group().all_reduce(held, {.op = comm::ReduceOp::kMin})->wait();
    if (held.item<double>() == 0) return std::nullopt;
    return *it;
  }

  // Whether a committed step's directory holds the data file of every rank that saved it: a
  // node's snapshot directory holds only its own ranks' files, and those its agent replicated.
  static bool holds_every_file(const ckpt::CheckpointInfo& info) {
    for (int r = 0; r < info.world_size; ++r) {
      if (!std::filesystem::exists(info.path / ckpt::data_file_name(r))) return false;
    }
    return true;
  }

  // The tensor names other ranks' states hold and this one's does not: the other pipeline
  // stages' parameters, which a strict load on this rank must leave to them. A tensor of the
  // checkpoint that no rank asks for stays an error. One all-gather over the control group.
  std::vector<std::string> tensors_of_other_ranks(const ckpt::State& state) {
    if (rt.world_size() == 1) return {};
    std::set<std::string> mine;
    std::string text;
    for (const ckpt::TensorEntry& e : state.tensors) {
      mine.insert(e.name);
      text += e.name + "\n";
    }
    std::set<std::string> others;
    for (const auto& lines : comm::internal::all_gather_lines(rt.control_group(), text, at::kCPU,
                                                              options.checkpoint_timeout)) {
      for (const std::string& name : lines) {
        if (mine.count(name) == 0) others.insert(name);
      }
    }
    return {others.begin(), others.end()};
  }

  // Resumes from the newest committed snapshot or checkpoint, whichever is newer (the snapshot
  // on a tie: it is in memory); returns whether there was one.
  bool resume() {
    if (!options.resume) return false;
    std::optional<ckpt::CheckpointInfo> on_disk;
    if (const auto steps = disk.checkpointer->list(); !steps.empty()) on_disk = steps.back();
    const std::optional<ckpt::CheckpointInfo> in_memory = agreed_newest_snapshot();
    const bool from_memory = in_memory && (!on_disk || in_memory->step >= on_disk->step);
    if (!from_memory && !on_disk) return false;
    Series& source = from_memory ? snapshots : disk;
    const ckpt::CheckpointInfo& newest = from_memory ? *in_memory : *on_disk;
    ckpt::State state;
    strategy.add_state(state);
    const bool same_world = newest.world_size == rt.world_size();
    at::Tensor rng = at::empty_like(disk.rng);
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
    for (std::string& name : tensors_of_other_ranks(state))
      load.leave_out.push_back(std::move(name));
    const int64_t loaded = source.checkpointer->load(newest.step, state, load);
    strategy.load_state(state);
    const auto corrupt_blob = [&](const char* why) {
      return CorruptData(detail::concat("resuming from ", source.what, " step ", loaded, " (",
                                        newest.path.string(), "): its 'trainer' blob is corrupt (",
                                        why, "): ", state.blobs.at("trainer"),
                                        ". Remove that step to resume from an earlier one."));
    };
    try {
      const json trainer = json::parse(state.blobs.at("trainer"));
      step = util::integer_field<int64_t>(trainer.at("step"), "step", "");
      if (options.loss_scaling.enabled && trainer.contains("loss_scale")) {
        loss_scale = trainer.at("loss_scale").get<double>();
        scale_good_steps = util::integer_field<int64_t>(trainer.at("loss_scale_good_steps"),
                                                        "loss_scale_good_steps", "");
      }
    } catch (const json::exception& e) {
      throw corrupt_blob(e.what());
    } catch (const CorruptData& e) {  // an integer that is not one (util::integer_field)
      throw corrupt_blob(e.what());
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
    rt.log().info("resumed from {} step {} ({}): continuing at step {}", source.what, loaded,
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

  // Waits for the series' save in flight, if any, and reports it committed; raises its error.
  void finish_pending(Series& series) {
    if (!series.pending.valid()) return;
    if (&series == &snapshots) {
      try {
        series.pending.wait(options.checkpoint_timeout);
      } catch (const Error& e) {
        // Raised on every rank alike (the commit carries it), so every rank stops taking
        // snapshots at the same step; checkpoints go on.
        rt.log().warn(
            "the in-memory snapshot of step {} failed: {}; no more snapshots in this run "
            "(checkpoints continue). Check the space of {} (tmpfs) or pass train.snapshot_every=0",
            series.pending.step(), e.what(), rt.topology().snapshot_dir.string());
        series.pending = {};
        series.checkpointer.reset();
        return;
      }
    } else {
      series.pending.wait(options.checkpoint_timeout);
    }
    const int64_t committed = series.pending.step();
    const bool skipped = series.pending.skipped();
    series.pending = {};
    if (skipped) return;
    metrics->on_checkpoint_committed(committed);
    if (&series == &snapshots) drop_older_snapshots(committed);
  }

  // After the resume, by the first rank of every node: removes the snapshots of steps after
  // `resumed` from its node's directory. A previous generation may have committed a step that
  // is not whole on every node (a node lost before its files were copied); training redoes
  // that step and snapshots it again. Every rank's first save comes after the first step's
  // control all-reduce, so after every node's removal.
  void drop_newer_snapshots(int64_t resumed) {
    if (!snapshots.checkpointer || rt.local_rank() != 0) return;
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator(rt.topology().snapshot_dir, ec)) {
      const std::optional<int64_t> newer = ckpt::parse_step_dir_name(entry.path().filename());
      if (newer && *newer > resumed) {
        rt.log().info("removing the snapshot of step {} ({}): training resumed at step {}", *newer,
                      entry.path().string(), resumed);
        std::filesystem::remove_all(entry.path(), ec);
      }
    }
  }

  // Retention of the snapshots, by the first rank of every node in its node's directory after
  // each commit: the newest committed step and the newest step whole on this node (all ranks'
  // files: with several nodes, the previous node's arrive by replication a little after the
  // commit) are kept, with the step in flight; every older step is removed. So a node holds at
  // most two snapshots and one being written, and losing the previous node never leaves it
  // without a whole one once one was copied.
  void drop_older_snapshots(int64_t committed) {
    if (rt.local_rank() != 0) return;
    int64_t keep = committed;
    for (const ckpt::CheckpointInfo& info : snapshots.checkpointer->list()) {
      if (info.step <= committed && holds_every_file(info)) keep = info.step;
    }
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator(rt.topology().snapshot_dir, ec)) {
      const std::optional<int64_t> old = ckpt::parse_step_dir_name(entry.path().filename());
      if (old && *old < keep) std::filesystem::remove_all(entry.path(), ec);
    }
  }

  void save(Series& series, bool sync) {
    finish_pending(series);
    series.rng.copy_(at::detail::getDefaultCPUGenerator().get_state());
    series.state = describe_state(series.rng);
    if (sync) {
      series.checkpointer->save_sync(step, series.state);
      metrics->on_checkpoint_committed(step);
    } else {
      series.pending = series.checkpointer->save(
          step, series.state,
          {.defer_copy = options.overlap_checkpoint_copy, .background_copy = background_copy});
    }
  }

  // Reports the series' save in flight once it has finished; raises its error. Never blocks.
  void poll_pending(Series& series) {
    if (series.pending.valid() && series.pending.done()) finish_pending(series);
  }

  // Whether this rank's last snapshot is still being written.
  bool snapshot_in_flight() const { return snapshots.pending.valid() && !snapshots.pending.done(); }

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
    if (batch_step.forward_backward != nullptr) {
      auto phase = timer.phase(Phase::kForwardBackward);
      strategy.set_sync(false);
      const MicroStep whole = batch_step.forward_backward(batch);
      loss_sum = whole.loss.detach().to(at::kDouble);
      tokens = whole.tokens;
      samples = whole.samples;
      strategy.reduce_accumulated_gradients();  // finish_gradient_sync below waits for it
    } else {
      auto phase = timer.phase(Phase::kForwardBackward);
      for (int64_t m = 0; m < options.micro_batches; ++m) {
        strategy.set_sync(m + 1 == options.micro_batches);
        MicroStep micro;
        {
          metrics::TraceSpan forward("train", "forward");
          micro = loss_fn(micro_batch(batch, m, options.micro_batches));
        }
        metrics::TraceSpan backward("train", "backward");
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
    if (disk.pending.valid() || snapshots.pending.valid()) {
      auto phase = timer.phase(Phase::kCheckpointStall);
      // The deferred copies, before the parameters change.
      if (disk.pending.valid()) disk.checkpointer->before_optimizer_step();
      if (snapshots.pending.valid()) snapshots.checkpointer->before_optimizer_step();
    }
    if (!info.skipped) {
      auto phase = timer.phase(Phase::kOptimizer);
      strategy.optimizer().set_lr(info.lr);
      strategy.step();
    }
    // One small all-reduce on the control group (host scalars, never the tensor group): the
    // loss sum, whether any rank was asked to stop (so every rank stops after the same step),
    // and whether any rank is still writing its last snapshot (so every rank skips the next).
    at::Tensor sums = at::tensor(
        {info.local_loss, g_stop_signal.load() != 0 ? 1.0 : 0.0, snapshot_in_flight() ? 1.0 : 0.0},
        at::kDouble);
    {
      // A wait on the other ranks like the gradients': a fast rank waits here for a slow one.
      auto phase = timer.phase(Phase::kCommWait);
      rt.control_group().all_reduce(sums)->wait();
    }
    info.loss = sums[0].item<double>() / rt.world_size();
    stop_agreed = sums[1].item<double>() > 0;
    snapshot_busy = sums[2].item<double>() > 0;
    // Also reported to the coordinator under `loom run` (Runtime::report_step).
    metrics->log_step({.step = step,
                       .epoch = static_cast<int64_t>(batch.epoch),
                       .loss = info.loss,
                       .lr = info.lr,
                       .grad_norm = info.grad_norm,
                       .tokens = tokens,
                       .samples = samples});
    return info;
  }

  FitResult fit() {
    StopSignals signals;
    metrics = std::make_unique<metrics::MetricsLogger>(
        rt, metrics::MetricsOptions{
                .flops_per_token = options.flops_per_token,
                .peak = options.flops_per_token > 0
                            ? metrics::peak_flops(rt.device(), rt.run_dir() / "peak_flops.json")
                            : metrics::PeakFlops{},
                .log_every = options.log_every});
    resolve_schedule();
    resolve_copy_place();
    open_checkpointers();
    FitResult result;
    if (!resume() && !options.init_from.empty()) init_weights();
    drop_newer_snapshots(step);
    result.start_step = step;
    metrics->on_resume(step);
    metrics::StepTracer tracer(rt, options.trace_steps);
    if (callbacks.on_start) callbacks.on_start(step);
    while (step < options.steps) {
      tracer.begin_step(step);
      const StepInfo info = run_step();
      ++step;
      result.last_loss = info.loss;
      if (callbacks.on_step_end) callbacks.on_step_end(info);
      poll_pending(disk);
      poll_pending(snapshots);
      if (options.checkpoint_every > 0 && step % options.checkpoint_every == 0 &&
          step < options.steps) {
        save(disk, false);
      }
      if (snapshots.checkpointer && step % options.snapshot_every == 0 && step < options.steps &&
          !snapshot_busy) {
        save(snapshots, false);  // the previous one is done on every rank: no wait
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
    finish_pending(snapshots);
    finish_pending(disk);
    const std::optional<int64_t> latest = disk.checkpointer->latest();
    if (!latest || *latest != step) save(disk, true);
    result.steps_done = step;
    result.skipped_steps = skipped;
    return result;
  }
};

Trainer::Trainer(Runtime& rt, parallel::Strategy& strategy, data::BatchSource& reader,
                 TrainOptions options, LossFn loss, Callbacks callbacks)
    : impl_(std::make_unique<Impl>(rt, strategy, reader, std::move(options), std::move(loss),
                                   BatchStep{}, std::move(callbacks))) {}

Trainer::Trainer(Runtime& rt, parallel::Strategy& strategy, data::BatchSource& reader,
                 TrainOptions options, BatchStep step, Callbacks callbacks)
    : impl_(std::make_unique<Impl>(rt, strategy, reader, std::move(options), LossFn{},
                                   std::move(step), std::move(callbacks))) {}

Trainer::~Trainer() = default;

FitResult Trainer::fit() { return impl_->fit(); }

}  // namespace loom::train
