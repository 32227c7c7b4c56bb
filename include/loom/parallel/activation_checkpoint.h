// parallel::checkpoint and parallel::ActivationCheckpoint: activation checkpointing. A
// checkpointed function keeps only its inputs during forward and recomputes its activations in
// backward, with the forward's random-number state replayed so that dropout draws the same mask:
// one extra forward of each checkpointed module buys back its activation memory.
//
//   // a function (like torch.utils.checkpoint, reentrant variant)
//   at::Tensor y = loom::parallel::checkpoint([&](const at::Tensor& x) { return mlp(x); }, x);
//   // a module
//   loom::parallel::ActivationCheckpoint block(MyBlock(...));   // forward = checkpoint(inner)
//   // a policy: every BlockImpl of a container, in place (names unchanged)
//   loom::parallel::checkpoint_modules_of_type<BlockImpl>(*model, model->blocks);
//
// How it works: a custom autograd function runs fn under no-grad, saving its inputs and the
// CPU generator's state (and each input CUDA device's generator state). Its backward sets those
// states, re-runs fn with grad on over detached copies of the inputs, puts the caller's
// generator states back, and backpropagates the incoming gradient through the recomputed graph
// with torch::autograd::backward (a reentrant backward). Parameters' gradients are therefore
// accumulated by their ordinary AccumulateGrad nodes, exactly once per backward, so
// DataParallel's gradient-accumulator post-hooks fire as they do without checkpointing; the
// inputs' gradients are returned to the outer backward. Gradients equal the uncheckpointed
// run's bit for bit when fn is deterministic given the generator states (CPU kernels are; on
// CUDA set run.deterministic), and after backward the generators are where they are without
// checkpointing (backward draws nothing from them).
//
// Limits (those of PyTorch's reentrant checkpoint): not with torch::autograd::grad or a backward
// restricted to `inputs` (parameter gradients go into .grad(), not to the caller), nor with
// create_graph (double backward). Randomness from generators other than the default CPU one and
// the inputs' CUDA devices' defaults is not replayed, and neither is autocast state. The
// generator is process-wide: ranks run as threads in one process share it, so their dropout
// draws interleave (in a checkpointed run and an ordinary one alike); ranks as processes do not.
//
// Thread safety: a checkpointed forward and its backward run on the training thread (CPU) or
// autograd's device thread (CUDA); the replayed generator states are per call, the generators
// themselves process-wide.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "loom/visibility.h"

namespace loom::parallel {

using CheckpointFn = std::function<at::Tensor(const at::Tensor&)>;
using CheckpointVectorFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

// Returns fn(input), keeping only `input` (and the generator states) for backward; see above.
// With grad mode off it is fn(input). With grad mode on, the result requires grad even when
// `input` does not (fn may use parameters that do); a backward through it then recomputes fn.
// fn must compute the same function of its input and the generator states every time it runs,
// and must outlive the backward (it is copied). Exceptions from fn propagate, from backward too.
LOOM_API at::Tensor checkpoint(const CheckpointFn& fn, const at::Tensor& input);
// The same with several inputs and outputs (every input a defined tensor). Outputs that do not
// require grad after the recompute, or get no gradient, take no part in the backward.
LOOM_API std::vector<at::Tensor> checkpoint(const CheckpointVectorFn& fn,
                                            const std::vector<at::Tensor>& inputs);

// Whether ActivationCheckpoint can wrap a module of type M: one non-template forward taking one
// tensor (by value or const reference) and returning a tensor.
template <class M, class = void>
struct is_checkpointable : std::false_type {};
template <class M>
struct is_checkpointable<
    M, std::void_t<decltype(&M::forward),
                   decltype(std::declval<M&>().forward(std::declval<const at::Tensor&>()))>>
    : std::is_convertible<decltype(std::declval<M&>().forward(std::declval<const at::Tensor&>())),
                          at::Tensor> {};
template <class M>
inline constexpr bool is_checkpointable_v = is_checkpointable<M>::value;

// A module whose forward is checkpoint(wrapped module's forward).
//
// Names: the wrapper registers the wrapped module's own parameters, buffers and children under
// their own names (the same tensors and modules, in the same order), not the wrapped module
// itself, so named_parameters() of a model is the same with and without wrappers
// ("blocks.0.fc.weight" either way): checkpoints, exports and DataParallel's name checks do not
// see checkpointing. Register everything on the wrapped module before wrapping it (later
// registrations on it are not mirrored). Consequences: named_modules() lists the wrapper where
// the wrapped module was (find wrapped modules by type through module()), and train(), eval()
// and to() are forwarded to the wrapped module. Not Cloneable.
//
// Construction throws InvalidArgument for a null module; a module type without
// at::Tensor forward(at::Tensor) does not compile (is_checkpointable), and through a type-erased
// AnyModule the first forward throws: AnyModule's own c10::Error for a forward taking other
// arguments, InvalidArgument for one returning something other than a tensor.
// Wrappers compose: an ActivationCheckpoint may wrap, or be wrapped by, another module with a
// Tensor(Tensor) forward (an ActivationCheckpoint too).
class LOOM_API ActivationCheckpointImpl : public torch::nn::Module {
 public:
  explicit ActivationCheckpointImpl(torch::nn::AnyModule module);
  template <class M>
  explicit ActivationCheckpointImpl(std::shared_ptr<M> module)
      : ActivationCheckpointImpl(any_of(std::move(module))) {}
  template <class M>
  explicit ActivationCheckpointImpl(const torch::nn::ModuleHolder<M>& module)
      : ActivationCheckpointImpl(module.is_empty() ? std::shared_ptr<M>() : module.ptr()) {}

  at::Tensor forward(const at::Tensor& input);

  // The wrapped module.
  const std::shared_ptr<torch::nn::Module>& module() const { return inner_; }

  void train(bool on = true) override;
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Device device, bool non_blocking = false) override;
  void pretty_print(std::ostream& stream) const override;

 private:
  template <class M>
  static torch::nn::AnyModule any_of(std::shared_ptr<M> module) {
    static_assert(is_checkpointable_v<M>,
                  "ActivationCheckpoint wraps a module with one at::Tensor forward(at::Tensor)");
    if (module == nullptr) return torch::nn::AnyModule();  // the constructor names the error
    return torch::nn::AnyModule(std::move(module));
  }
  // module's forward(input); InvalidArgument when it returns something other than a tensor.
  static at::Tensor call(torch::nn::AnyModule& module, const at::Tensor& input);

  // Constant after construction.
  torch::nn::AnyModule any_;                  // the wrapped module's forward
  std::shared_ptr<torch::nn::Module> inner_;  // the wrapped module
};
TORCH_MODULE(ActivationCheckpoint);

namespace detail {
// Registers `replacement` under the name `parent` has `child` under. InvalidArgument when
// `child` is not a direct child of `parent`.
LOOM_API void replace_child(torch::nn::Module& parent, const torch::nn::Module& child,
                            std::shared_ptr<torch::nn::Module> replacement);
}  // namespace detail

// The policy: wraps every element of `list` that is a ModuleImpl (or derives from it) in an
// ActivationCheckpoint, and returns how many it wrapped. libtorch's containers cannot replace an
// element, so this builds a new container with the same elements (wrapped where they match)
// under the same names, registers it under `parent` in place of `list`, and points `list` at
// it. Cost: one pass over the elements, no tensor is copied or moved, parameter names stay the
// same and parameters keep their identity (an optimizer or DataParallel built before still
// holds the right tensors; wrapping before building them is still the clearer order).
// InvalidArgument when `list` is not a direct child of `parent`.
template <class ModuleImpl>
int checkpoint_modules_of_type(torch::nn::Module& parent, torch::nn::ModuleList& list) {
  static_assert(
      is_checkpointable_v<ModuleImpl>,
      "checkpoint_modules_of_type needs a module type with at::Tensor forward(at::Tensor)");
  torch::nn::ModuleList rebuilt;
  int wrapped = 0;
  for (const std::shared_ptr<torch::nn::Module>& element : *list) {
    if (auto match = std::dynamic_pointer_cast<ModuleImpl>(element)) {
      rebuilt->push_back(ActivationCheckpoint(std::move(match)));
      ++wrapped;
    } else {
      rebuilt->push_back(element);
    }
  }
  detail::replace_child(parent, *list, rebuilt.ptr());
  list = rebuilt;
  return wrapped;
}

// The same for a Sequential; element names (indices or the names given to push_back) are kept.
template <class ModuleImpl>
int checkpoint_modules_of_type(torch::nn::Module& parent, torch::nn::Sequential& sequential) {
  static_assert(
      is_checkpointable_v<ModuleImpl>,
      "checkpoint_modules_of_type needs a module type with at::Tensor forward(at::Tensor)");
  torch::nn::Sequential rebuilt;
  int wrapped = 0;
  const auto names = sequential->named_children();  // in element order
  for (size_t i = 0; i < sequential->size(); ++i) {
    const torch::nn::AnyModule& element = *(sequential->begin() + static_cast<std::ptrdiff_t>(i));
    std::string name = names[i].key();  // by value: a const& picks Sequential's private push_back
    if (auto match = std::dynamic_pointer_cast<ModuleImpl>(element.ptr())) {
      rebuilt->push_back(std::move(name), ActivationCheckpoint(std::move(match)));
      ++wrapped;
    } else {
      rebuilt->push_back(std::move(name), element);
    }
  }
  detail::replace_child(parent, *sequential, rebuilt.ptr());
  sequential = rebuilt;
  return wrapped;
}

}  // namespace loom::parallel
