// parallel::FullyShardedDataParallel (FSDP, ZeRO-3): data-parallel training where every rank
// keeps only its 1/W shard of the parameters, gradients and optimizer state; a unit's
// parameters are all-gathered just before its forward and its backward and freed after.
//
//   model->blocks: a torch::nn::Sequential (or ModuleList) of Block modules
//   loom::parallel::wrap_modules<Block>(model->blocks);     // each Block becomes an FsdpUnit
//   loom::parallel::FullyShardedDataParallel fsdp(model, group);
//   fsdp.set_optimizer(std::make_unique<loom::optim::AdamW>(loom::optim::AdamWOptions{}));
//   for (each step) {
//     fsdp.zero_grad();
//     { auto guard = fsdp.no_sync(); for (first M-1 micro-batches) loss(model, mb).backward(); }
//     loss(model, last_mb).backward();   // each unit's gradients reduce-scattered as they arrive
//     fsdp.finish_gradient_sync();       // waits for the reduce-scatters (with a deadline)
//     fsdp.clip_grad_norm(1.0);          // optional: global norm over the shards
//     fsdp.step();                       // the update of this rank's shards only
//   }
//
// Units: an FsdpUnit wraps one module with `Tensor forward(Tensor)` (a transformer block, an
// embedding, an ActivationCheckpoint around a block) and stands where that module stood; the
// parameters of the model in no unit form the root unit. Each unit's parameters are one flat
// buffer padded to a multiple of W, of which rank r owns [r P/W, (r+1) P/W) (as DataParallel's
// buckets). The root unit stays gathered (its parameters are full between steps, like ZeRO-2);
// wrap large modules to shard them. See docs/parallel.md, "FSDP".
//
// Ownership: the FSDP shares the module and must outlive every forward and backward through it,
// and must not outlive the group. It rewires the parameters: outside a unit's forward and
// backward a unit's parameters are empty tensors (read them with gather_full_parameters()).
// Thread safety: one thread at a time, the one that runs forward and backward. Collective calls
// (construction, every unit's forward and backward, finish_gradient_sync with sync on,
// clip_grad_norm, step, gather_full_parameters, load_state) must be made by every rank in the
// same order: every rank runs the same model code.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "loom/comm/group.h"
#include "loom/config.h"
#include "loom/optim/flat_optimizer.h"
#include "loom/parallel/strategy.h"
#include "loom/visibility.h"

namespace loom::ckpt {
struct State;
}

namespace loom::parallel {

namespace detail {
// What an FsdpUnit calls around its module's forward; implemented by FullyShardedDataParallel.
class LOOM_API FsdpUnitHooks {
 public:
  virtual ~FsdpUnitHooks() = default;
  // Gathers the unit's parameters; returns the input as the unit computes on it.
  virtual at::Tensor before_forward(int unit, const at::Tensor& input) = 0;
  virtual at::Tensor after_forward(int unit, at::Tensor output) = 0;
};
}  // namespace detail

// A unit's own mixed-precision policy; a field that is set wins over FsdpOptions' for this unit.
// Read when the FullyShardedDataParallel is built.
struct FsdpUnitOptions {
  // The dtype the unit's parameters are gathered in and computed in (FsdpOptions::param_dtype).
  std::optional<at::ScalarType> param_dtype;
  // The dtype its gradients are reduce-scattered in (FsdpOptions::reduce_dtype). Unset: when
  // this unit sets param_dtype, that dtype; otherwise FsdpOptions' policy.
  std::optional<at::ScalarType> reduce_dtype;
};

// Marks one FSDP unit: wraps a module with `Tensor forward(Tensor)`. The wrapped module's
// children, parameters and buffers are registered directly on the unit, so parameter names are
// those of the unwrapped model ("blocks.3.fc.weight"): state saved by FSDP loads into an
// unwrapped model (DataParallel) and back. Without a FullyShardedDataParallel over it (or after
// that is destroyed) forward() is the wrapped module's forward.
class LOOM_API FsdpUnitImpl : public torch::nn::Module {
 public:
  // InvalidArgument when a dtype in `options` is not a floating-point type.
  explicit FsdpUnitImpl(torch::nn::AnyModule module, const FsdpUnitOptions& options = {});
  template <typename M>
  explicit FsdpUnitImpl(std::shared_ptr<M> module, const FsdpUnitOptions& options = {})
      : FsdpUnitImpl(torch::nn::AnyModule(module), options) {}
  template <typename M>
  explicit FsdpUnitImpl(const torch::nn::ModuleHolder<M>& module,
                        const FsdpUnitOptions& options = {})
      : FsdpUnitImpl(torch::nn::AnyModule(module.ptr()), options) {}

  // Under a param_dtype policy a floating-point input is first cast to the unit's compute dtype.
  at::Tensor forward(const at::Tensor& input);
  // The unit's policy; set it before building the FullyShardedDataParallel (e.g. on a unit made
  // by wrap_modules). InvalidArgument as the constructor.
  void set_options(const FsdpUnitOptions& options);
  const FsdpUnitOptions& options() const { return options_; }
  // The wrapped module.
  std::shared_ptr<torch::nn::Module> wrapped() const { return wrapped_.ptr(); }
  // Also switches the wrapped module itself (its children are the unit's children).
  void train(bool on = true) override;
  void pretty_print(std::ostream& stream) const override;

 private:
  friend class FullyShardedDataParallel;
  torch::nn::AnyModule wrapped_;
  FsdpUnitOptions options_;
  detail::FsdpUnitHooks* hooks_ = nullptr;  // set while a FullyShardedDataParallel is attached
  int index_ = -1;
};
TORCH_MODULE(FsdpUnit);

namespace detail {
LOOM_API int wrap_sequential(
    torch::nn::Sequential& sequential,
    const std::function<bool(const std::shared_ptr<torch::nn::Module>&)>& match);
LOOM_API void replace_list_element(torch::nn::ModuleList& list, size_t index,
                                   std::shared_ptr<torch::nn::Module> module);
}  // namespace detail

// The wrapping policy: replaces every element of `sequential` that is a T (the module class,
// e.g. BlockImpl for TORCH_MODULE(Block)) by an FsdpUnit around it, in place. Returns how many
// were wrapped. Sequential::forward then runs the units unchanged.
template <typename T>
int wrap_modules(torch::nn::Sequential& sequential) {
  return detail::wrap_sequential(sequential, [](const std::shared_ptr<torch::nn::Module>& m) {
    return std::dynamic_pointer_cast<T>(m) != nullptr;
  });
}
// The same for a ModuleList. Its elements become FsdpUnits, so a loop that called
// list[i]->as<T>()->forward(x) must call list[i]->as<FsdpUnitImpl>()->forward(x) instead.
template <typename T>
int wrap_modules(torch::nn::ModuleList& list) {
  int wrapped = 0;
  for (size_t i = 0; i < list->size(); ++i) {
    if (auto module = std::dynamic_pointer_cast<T>(list->ptr(i))) {
      detail::replace_list_element(list, i, std::make_shared<FsdpUnitImpl>(module));
      ++wrapped;
    }
  }
  return wrapped;
}

struct LOOM_API FsdpOptions {
  // Free a unit's gathered parameters after its forward (gathered again before its backward).
  // false: they stay gathered from forward until the unit's backward is done (less
  // communication, more memory).
  bool reshard_after_forward = true;
  // Launch the next unit's all-gather when a unit's forward starts (unit i+1, in unit order)
  // and the previous unit's when a unit's backward starts (unit i-1), so that communication
  // overlaps compute. false: every gather is launched when it is needed.
  bool prefetch = true;
  // Non-fp32 (bf16) parameters get fp32 master shards that the optimizer updates; the
  // parameter shards are rounded from them. Optimizer state is always fp32.
  bool master_weights = true;
  // The mixed-precision policy (PyTorch FSDP's MixedPrecision(param_dtype)): the compute dtype,
  // e.g. at::kBFloat16 for an fp32 model. The shards keep the parameters' dtype and are the
  // master copy (no separate master shard); before a unit's forward and backward its shard is
  // cast and gathered into a param_dtype buffer, so the module's parameters are param_dtype
  // tensors (empty outside the unit's forward and backward; the root's stay gathered). Gradients
  // arrive in param_dtype, are reduce-scattered in reduce_dtype (unset: param_dtype) and added
  // into fp32 gradient shards, which clipping and the optimizer read. A unit casts a
  // floating-point input to its compute dtype; frozen parameters and buffers keep their dtype.
  // FsdpUnitOptions override it per unit. Unset: compute in the parameters' dtype.
  std::optional<at::ScalarType> param_dtype;
  // The dtype gradients are reduce-scattered in and (without param_dtype) gradient shards are
  // kept in; unset: the compute dtype (bf16 gradients are then summed in fp32 inside the group
  // and rounded to bf16 once, as DataParallel does). at::kFloat with bf16 parameters: each
  // unit's unsharded bf16 gradient is converted to fp32 before the reduce-scatter (one rounding
  // less, twice the bytes on the wire).
  std::optional<at::ScalarType> reduce_dtype;
  // CPU offload of the optimizer (DeepSpeed's offload_optimizer, PyTorch FSDP's CPUOffload for
  // the optimizer): the optimizer state and an fp32 master copy of every shard live in host
  // memory (pinned when the parameters are on a GPU); step() copies each reduced gradient shard
  // to the host, runs the update there and copies the updated shard back. The device then holds
  // only the parameter and gradient shards between steps. The arithmetic is the same, so the
  // results are bitwise those without offload; checkpoints have the same names and layout
  // (an fp32 parameter's host master is not saved: it equals its shard).
  bool offload_optimizer_state = false;
  // Deadline of every wait: construction's checks, gathers, reduce-scatters, clip, step, load.
  std::chrono::milliseconds timeout = comm::kDefaultCollectiveTimeout;
  // Tensor and pipeline parallelism around FSDP (strategy.h): checkpoints of the whole model's
  // pieces, the whole model's gradient norm, tied parameters' gradients.
  ModelParallel model_parallel;

  // The config keys: parallel.reshard_after_forward, parallel.reduce_dtype ("" for the
  // parameters' dtype, or fp32), parallel.param_dtype ("" or bf16),
  // parallel.offload_optimizer_state.
  static ConfigSchema schema();
  // Reads them; a bad value is ConfigError naming the key.
  static FsdpOptions from(const Config& config);
};

// Bytes of training state this rank holds, counted from the live storages FSDP allocated.
struct FsdpMemory {
  int64_t parameter_bytes = 0;  // parameter shards + gathered (unsharded) unit parameters
  int64_t gradient_bytes = 0;   // gradient shards + unsharded gradients being accumulated/reduced
  int64_t optimizer_bytes = 0;  // optimizer state + fp32 master shards on the device
  // Under offload_optimizer_state: the optimizer state and fp32 masters in host memory. Not in
  // total(), which counts what the parameters' device holds.
  int64_t offloaded_optimizer_bytes = 0;
  int64_t total() const { return parameter_bytes + gradient_bytes + optimizer_bytes; }
};

// Counters since construction; for tests and benchmarks.
struct FsdpStats {
  int64_t all_gathers = 0;          // parameter all-gathers launched
  int64_t forward_prefetched = 0;   // unit forwards whose all-gather was launched before it began
  int64_t backward_prefetched = 0;  // unit backwards whose all-gather was launched before it began
  int64_t reduce_scatters_in_backward = 0;  // launched by gradient hooks while backward ran
  int64_t reduce_scatters = 0;              // all gradient reduce-scatters
  // Time the training thread spent blocked on gathers and reduce-scatters: the communication
  // that prefetch and overlap did not hide.
  double gather_wait_seconds = 0;
  double reduce_wait_seconds = 0;
};

class LOOM_API FullyShardedDataParallel final : public Strategy, private detail::FsdpUnitHooks {
 public:
  // Collective. InvalidArgument naming the dtype when param_dtype or reduce_dtype is not a
  // floating-point type. Finds the FsdpUnits in `module` (InvalidArgument naming the module or
  // parameter when units overlap, a unit appears twice, a module is wrapped twice, or a parameter
  // is in two units), checks that every rank has the same parameters and units (InvalidArgument
  // naming the first mismatch and the rank), broadcasts rank 0's parameters and buffers, and
  // shards the parameters. Parameters with requires_grad false are left as they are.
  FullyShardedDataParallel(std::shared_ptr<torch::nn::Module> module, comm::Group& group,
                           const FsdpOptions& options = {});
  // Waits for nothing and runs no collective: waits for in-flight ops only to release their
  // tensors. Unit parameters are left empty.
  ~FullyShardedDataParallel() override;
  FullyShardedDataParallel(const FullyShardedDataParallel&) = delete;
  FullyShardedDataParallel& operator=(const FullyShardedDataParallel&) = delete;

  torch::nn::Module& module() const override;
  const FsdpOptions& options() const;

  // With sync off, backward keeps each unit's unsharded gradient and accumulates into it
  // (micro-steps of gradient accumulation, as PyTorch's FSDP no_sync); the backward after
  // set_sync(true) reduce-scatters the accumulated sum.
  void set_sync(bool sync) override;
  bool sync() const;
  class NoSync {
   public:
    explicit NoSync(FullyShardedDataParallel& fsdp);
    ~NoSync();
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;

   private:
    FullyShardedDataParallel& fsdp_;
    bool previous_;
  };
  NoSync no_sync() { return NoSync(*this); }

  // Waits for every unit's reduce-scatter of the last synced backward (averaged over ranks)
  // and adds it into the unit's gradient shard. Timeout/CommError name the unit and its
  // parameters; InvalidArgument when no gradient arrived, or a parameter got none. A no-op while
  // sync is off.
  void finish_gradient_sync() override;
  // After backwards under no_sync: sums tied parameters' gradients (ModelParallel::tied) and
  // launches every unit's reduce-scatter; finish_gradient_sync waits for them (strategy.h).
  void reduce_accumulated_gradients() override;
  // Zeroes the gradient shards and drops gradients accumulated under no_sync.
  void zero_grad() override;
  // As DataParallel::clip_grad_norm (torch::nn::utils::clip_grad_norm_'s formula) over the
  // gradient shards. Returns the norm before clipping. Collective; after finish_gradient_sync.
  double clip_grad_norm(double max_norm) override;
  // Multiplies the gradient shards by `factor` (unscaling after loss scaling).
  void scale_gradients(double factor) override;
  // The first parameter whose part of a gradient shard has a NaN or Inf; empty when none.
  std::string first_non_finite_gradient() const override;

  void set_optimizer(std::unique_ptr<optim::FlatOptimizer> optimizer) override;
  optim::FlatOptimizer& optimizer() const override;
  int64_t step_count() const;
  // One optimizer step on this rank's shards; the root unit is gathered again. Collective.
  void step() override;

  // The full parameters by name (the model's names), gathered from the shards. Collective.
  std::map<std::string, at::Tensor> gather_full_parameters();

  // Adds views of this rank's shards to `state`, with DataParallel's names: "model/<param>",
  // "optim/<param>/<state name>", "optim/<param>/master", each Sharding::flat over the part of
  // the parameter's elements this rank owns (an empty piece when none), and the blob "optim"
  // ({"optimizer", "step", "mode": "fsdp"}). The checkpointer stores every piece as an element
  // range of the global tensor, so the state loads into DataParallel at any stage and world size
  // (its replicated "model/" entries are read as the whole range) and vice versa.
  void add_state(ckpt::State& state) override;
  // Loads what add_state describes (pieces found by name and range) and refreshes the gathered
  // root. Collective. InvalidArgument naming a missing entry or a range that does not match.
  void load_state(const ckpt::State& state) override;
  // Gathers the full parameters, fills them from the checkpoint's "model/" tensors
  // (ckpt::load_model_weights, strict), and writes this rank's slices into the shards and the
  // fp32 masters. Collective.
  int64_t load_weights(const std::filesystem::path& ckpt_dir, int64_t step) override;

  // Optimizer state and fp32 masters, on the device or offloaded to the host.
  int64_t optimizer_state_bytes() const;
  FsdpMemory memory() const;
  // The largest total() seen since construction or reset_peak_memory, and its breakdown.
  FsdpMemory peak_memory() const;
  void reset_peak_memory();
  const FsdpStats& stats() const;

  // Units in order: the FsdpUnits in module order, then the root unit when any parameter is in
  // no unit. unit_name is the unit's module path ("blocks.0") or "(root)".
  int unit_count() const;
  std::string unit_name(int unit) const;
  std::vector<std::string> unit_parameters(int unit) const;

 private:
  at::Tensor before_forward(int unit, const at::Tensor& input) override;
  at::Tensor after_forward(int unit, at::Tensor output) override;

  struct LOOM_HIDDEN Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace loom::parallel
