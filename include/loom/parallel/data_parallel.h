// parallel::DataParallel: data-parallel training of one torch::nn::Module over a comm::Group,
// with gradients reduced in buckets while backward is still running (DDP), and optionally the
// optimizer state (ZeRO-1) and reduced gradients (ZeRO-2) sharded across the ranks.
//
//   loom::parallel::DataParallel dp(model, group, {.zero_stage = loom::parallel::ZeroStage::kTwo});
//   dp.set_optimizer(std::make_unique<loom::optim::AdamW>(loom::optim::AdamWOptions{.lr = 3e-4}));
//   for (each step) {
//     dp.zero_grad();
//     { auto guard = dp.no_sync(); for (first M-1 micro-batches) loss(model, mb).backward(); }
//     loss(model, last_mb).backward();   // buckets are all-reduced as their gradients arrive
//     dp.finish_gradient_sync();         // waits for the buckets (with a deadline)
//     dp.clip_grad_norm(1.0);            // optional: global norm across shards
//     dp.step();                         // sharded update, parameters all-gathered back
//   }
//
// How it works (docs/parallel.md): at construction the parameters that require grad are laid
// out, in reverse registration order, in flat per-bucket buffers; each parameter's data and its
// .grad() become views into them. A post-hook on each parameter's gradient accumulator (the
// autograd node that adds the new gradient into .grad()) marks it ready after accumulation, so
// micro-step accumulation is already in the buffer; when a bucket's parameters are all ready it
// is reduced asynchronously, buckets always in index order on every rank.
//
// ZeRO-2 (kTwo) keeps no full-size gradients: in a synced backward each parameter's gradient
// moves from .grad() into its bucket's staging buffer as it arrives (.grad() is then undefined),
// and the staging buffer is freed once the bucket's reduce-scatter into this rank's gradient
// shard completes. Under no_sync gradients accumulate in .grad() as without DataParallel.
//
// Ownership: the DataParallel shares the module and must not outlive the group. It rewires the
// module's parameters (set_data to views) and, for kNone/kOne, their .grad(); do not replace
// them (a replaced .grad() is copied back into the bucket at the next hook). Thread safety: one
// thread at a time, the one that runs backward. Collective calls (construction,
// finish_gradient_sync with sync on, clip_grad_norm, step, load_state) must be made by every rank
// in the same order.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "loom/comm/group.h"
#include "loom/config.h"
#include "loom/optim/flat_optimizer.h"
#include "loom/parallel/strategy.h"
#include "loom/parallel/zero.h"
#include "loom/visibility.h"

namespace torch::nn {
class Module;
}
namespace loom::ckpt {
struct State;
}

namespace loom::parallel {

enum class GradReduction {
  kMean,  // gradients averaged over ranks: the loss is a per-rank mean (the usual DDP choice)
  kSum,   // gradients summed over ranks
};

struct LOOM_API DataParallelOptions {
  size_t bucket_bytes = 25u << 20;  // a bucket closes once its parameters reach this many bytes
  ZeroStage zero_stage = ZeroStage::kNone;  // which state is sharded (see zero.h)
  GradReduction reduction = GradReduction::kMean;
  // false: a parameter that got no gradient in a synced backward is an InvalidArgument naming
  // it. true: its (zero, or accumulated-so-far) gradient is reduced like the others at
  // finish_gradient_sync, and the optimizer steps it.
  bool find_unused_parameters = false;
  // Deadline of every wait: construction's checks, finish_gradient_sync, clip, step, load.
  std::chrono::milliseconds timeout = comm::kDefaultCollectiveTimeout;
  // Non-fp32 (e.g. bf16) parameters get fp32 master weights for this rank's slice; the
  // optimizer updates the masters and the parameters are rounded from them. Optimizer state is
  // always fp32.
  bool master_weights = true;
  // false: buckets are reduced only in finish_gradient_sync, after backward (to measure what
  // overlap hides; never faster).
  bool overlap = true;
  // kTwo: at most this many buckets' full-size staging buffers at once. Backward that needs
  // another first waits for the oldest reduce-scatter in flight (when one is in flight); a
  // bucket over twice bucket_bytes (it holds a parameter larger than a bucket, e.g. an
  // embedding) is staged alone. 0: no limit. Gradient bytes per rank are then about padded/W +
  // max(this many buckets, the largest bucket).
  int max_staging_buckets = 2;
  // Tensor and pipeline parallelism around this data parallelism (strategy.h): checkpoints of
  // the whole model's pieces, the whole model's gradient norm, tied parameters' gradients.
  ModelParallel model_parallel;

  // The config keys: parallel.bucket_mb (bucket_bytes in MiB), parallel.find_unused_parameters.
  static ConfigSchema schema();
  // Reads them and parallel.mode (ddp, zero1 or zero2: zero_stage) from a config built with
  // strategy_schema(); bad values are ConfigError naming the key (fsdp too: that is
  // FullyShardedDataParallel, which make_strategy builds).
  static DataParallelOptions from(const Config& config);
};

// What the last finish_gradient_sync cost; for benchmarks and logs.
struct SyncStats {
  int buckets_launched_during_backward = 0;  // reduced while backward still ran
  int buckets = 0;                           // all buckets
  double wait_seconds = 0;                   // time finish_gradient_sync blocked on communication
  // The most bytes of gradient buffers DataParallel held at once in that sync window: the
  // full-size bucket buffers for kNone/kOne; for kTwo the gradient shards plus the staging
  // buffers of the buckets not yet reduce-scattered (gradients that autograd holds in .grad()
  // before DataParallel takes them, one parameter at a time, are not counted).
  int64_t peak_gradient_bytes = 0;
};

class LOOM_API DataParallel final : public Strategy {
 public:
  // Collective. Checks that every rank has the same parameter names, shapes and dtypes
  // (InvalidArgument naming the first mismatch and the rank), then broadcasts rank 0's
  // parameters and buffers. Throws Timeout/CommError from the group. The checks' bytes travel
  // over `group` on the parameters' device.
  DataParallel(std::shared_ptr<torch::nn::Module> module, comm::Group& group,
               const DataParallelOptions& options = {});
  // The same, with the construction checks (host bytes) over `control`, a group of CPU
  // tensors with the same ranks (Runtime::control_group()); `group` then carries only the
  // parameters' and gradients' tensors. Both groups must outlive the DataParallel.
  DataParallel(std::shared_ptr<torch::nn::Module> module, comm::Group& group, comm::Group& control,
               const DataParallelOptions& options = {});
  ~DataParallel() override;
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  torch::nn::Module& module() const override;
  const DataParallelOptions& options() const;

  // With sync off, backward only accumulates gradients locally (micro-steps of gradient
  // accumulation); the backward after set_sync(true) reduces the accumulated sum.
  void set_sync(bool sync) override;
  bool sync() const;
  // RAII: sync off for its lifetime, restored after.
  class NoSync {
   public:
    explicit NoSync(DataParallel& dp);
    ~NoSync();
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;

   private:
    DataParallel& dp_;
    bool previous_;
  };
  NoSync no_sync() { return NoSync(*this); }

  // Waits for every bucket's reduction of the last synced backward. Timeout (or CommError)
  // names the bucket and its parameters when a peer did not reduce it (e.g. skipped backward).
  // InvalidArgument when no gradient arrived since the last sync, or a parameter got none
  // (unless find_unused_parameters). A no-op while sync is off.
  void finish_gradient_sync() override;
  // After backwards under no_sync: sums tied parameters' gradients (ModelParallel::tied) and
  // launches every bucket's reduction; finish_gradient_sync waits for them (strategy.h).
  void reduce_accumulated_gradients() override;
  const SyncStats& last_sync_stats() const;

  // Zeroes every gradient (the bucket buffers). Call before the first micro-step of a step.
  void zero_grad() override;

  // Scales the reduced gradients so that their global 2-norm is at most max_norm, like
  // torch::nn::utils::clip_grad_norm_ on the unsharded gradients (coefficient
  // max_norm / (norm + 1e-6), clamped to 1); the norm is computed in fp32 from the shards and
  // all-reduced. Returns the norm before clipping. Collective; after finish_gradient_sync.
  double clip_grad_norm(double max_norm) override;

  // Multiplies the reduced gradients (this rank's slices for kTwo) by `factor`: unscaling after
  // loss scaling (factor = 1 / scale). On the parameters' device, no host read. After
  // finish_gradient_sync, before clip_grad_norm and step.
  void scale_gradients(double factor) override;

  // The optimizer step() uses. Required before step().
  void set_optimizer(std::unique_ptr<optim::FlatOptimizer> optimizer) override;
  optim::FlatOptimizer& optimizer() const override;
  int64_t step_count() const;

  // One optimizer step on this rank's slice (kOne/kTwo) or everything (kNone), then the slices
  // are all-gathered into the parameters. Collective for kOne/kTwo. After finish_gradient_sync.
  void step() override;

  // Adds views of this rank's state to `state`: "model/<param>" (replicated parameters),
  // "optim/<param>/<state name>" and "optim/<param>/master" (fp32), each with Sharding::flat
  // over the part of the parameter's elements this rank owns (Sharding::replicated for kNone),
  // and the blob "optim" (optimizer, step). Names do not depend on the world size or the bucket
  // size. Under model parallelism (options().model_parallel) each is described as its piece of
  // the whole model's tensor (tp::checkpoint_piece, then Sharding::part for this rank's slice).
  // Because the tensors are views, a checkpointer may also fill them in place; then call load_state
  // with the same State.
  void add_state(ckpt::State& state) override;
  // Loads what add_state describes from `state` (entries found by name and range, possibly
  // saved at another world size and re-sliced) and re-synchronises the parameters. Collective.
  // InvalidArgument naming a missing entry or a range that does not match.
  void load_state(const ckpt::State& state) override;
  // Call after writing the module's parameters in place on every rank alike (loading weights,
  // e.g. ckpt::load_model_weights): re-derives the fp32 master weights from them. The
  // optimizer state is left as it is.
  void parameters_changed();
  // ckpt::load_model_weights into the module's parameters, then parameters_changed().
  int64_t load_weights(const std::filesystem::path& ckpt_dir, int64_t step) override;

  // The first parameter (in bucket order) whose reduced gradient has a NaN or Inf in the part
  // this rank holds (its slice for kTwo, all of it otherwise); empty when none. After
  // finish_gradient_sync; reads the gradients back to the host, so for error messages only.
  std::string first_non_finite_gradient() const override;

  // Bytes of optimizer state plus master weights held by this rank.
  int64_t optimizer_state_bytes() const;
  int bucket_count() const;
  // The parameter names in bucket b, in bucket order.
  std::vector<std::string> bucket_parameters(int b) const;

 private:
  DataParallel(std::shared_ptr<torch::nn::Module> module, comm::Group& group, comm::Group* control,
               const DataParallelOptions& options);

  struct LOOM_HIDDEN Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace loom::parallel
