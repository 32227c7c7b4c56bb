// Loom's optimizers: AdamW and SGD (with momentum) that update flat 1-D fp32 buffers, so that a
// ZeRO shard (a slice of a flattened bucket of parameters) can be stepped without knowing which
// parameters it cuts through. They reproduce libtorch 1.13's torch::optim::AdamW and
// torch::optim::SGD op for op: the same element-wise updates in the same order, so a flat
// update equals the per-parameter one (bitwise on the same inputs; see docs/parallel.md).
//
// An optimizer holds only hyperparameters; the state tensors (moments, momentum buffers) are
// owned by the caller (parallel::DataParallel keeps one set per bucket shard). Objects are
// immutable apart from set_lr, and safe to share between threads when nobody calls set_lr.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "loom/visibility.h"

namespace loom::optim {

// torch::optim::AdamWOptions' defaults.
struct AdamWOptions {
  double lr = 1e-3;            // learning rate
  double beta1 = 0.9;          // decay of the first moment (gradient average)
  double beta2 = 0.999;        // decay of the second moment (squared-gradient average)
  double eps = 1e-8;           // added to the bias-corrected sqrt of the second moment
  double weight_decay = 1e-2;  // decoupled: p *= 1 - lr * weight_decay before the Adam update
};

// torch::optim::SGDOptions' defaults, apart from lr, which libtorch requires and we default.
struct SgdOptions {
  double lr = 1e-2;           // learning rate
  double momentum = 0.0;      // 0 = plain SGD, no state
  double dampening = 0.0;     // momentum buffer takes (1 - dampening) of each new gradient
  double weight_decay = 0.0;  // L2: the gradient gets weight_decay * p added
  bool nesterov = false;      // Nesterov momentum (needs momentum > 0, dampening == 0)
};

// An update rule on flat fp32 tensors. Throws InvalidArgument on bad options at construction.
class LOOM_API FlatOptimizer {
 public:
  virtual ~FlatOptimizer() = default;
  // "adamw" or "sgd"; stored in checkpoints.
  virtual std::string name() const = 0;
  // The per-element state tensors, e.g. {"exp_avg", "exp_avg_sq"}; empty for plain SGD.
  virtual std::vector<std::string> state_names() const = 0;
  // One update of params (1-D fp32, updated in place) from grads (same size, fp32). state holds
  // one tensor per state_names(), shaped like params, zero before step 1; step counts from 1.
  virtual void update(const at::Tensor& params, const at::Tensor& grads,
                      std::vector<at::Tensor>& state, int64_t step) const = 0;
  virtual double lr() const = 0;
  virtual void set_lr(double lr) = 0;
};

// On CPU tensors: ATen ops, as torch::optim::AdamW. On CUDA tensors (fp32, contiguous, one
// device): one fused kernel launch on torch's current stream (kernels/adamw.h) that computes the
// same float operations in the same order, so a CUDA step equals the CPU step bit for bit on
// the same inputs; no host synchronisation.
class LOOM_API AdamW final : public FlatOptimizer {
 public:
  explicit AdamW(const AdamWOptions& options = {});
  std::string name() const override { return "adamw"; }
  std::vector<std::string> state_names() const override { return {"exp_avg", "exp_avg_sq"}; }
  void update(const at::Tensor& params, const at::Tensor& grads, std::vector<at::Tensor>& state,
              int64_t step) const override;
  // update(), then bf16_params (a bf16 buffer shaped like params; undefined = none) receives the
  // updated params rounded to nearest even. On CUDA it is written in the same pass.
  void update_with_bf16_copy(const at::Tensor& params, const at::Tensor& grads,
                             std::vector<at::Tensor>& state, int64_t step,
                             const at::Tensor& bf16_params) const;
  double lr() const override { return options_.lr; }
  void set_lr(double lr) override { options_.lr = lr; }
  const AdamWOptions& options() const { return options_; }

 private:
  void update_on_cpu(const at::Tensor& params, const at::Tensor& grads,
                     std::vector<at::Tensor>& state, int64_t step) const;

  AdamWOptions options_;
};

class LOOM_API Sgd final : public FlatOptimizer {
 public:
  explicit Sgd(const SgdOptions& options = {});
  std::string name() const override { return "sgd"; }
  std::vector<std::string> state_names() const override;
  void update(const at::Tensor& params, const at::Tensor& grads, std::vector<at::Tensor>& state,
              int64_t step) const override;
  double lr() const override { return options_.lr; }
  void set_lr(double lr) override { options_.lr = lr; }
  const SgdOptions& options() const { return options_; }

 private:
  SgdOptions options_;
};

}  // namespace loom::optim
