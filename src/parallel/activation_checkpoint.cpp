// Activation checkpointing (activation_checkpoint.h): the reentrant checkpoint autograd function
// with generator-state replay, and the ActivationCheckpoint module around it.
#include "loom/parallel/activation_checkpoint.h"

#include <ATen/core/ivalue.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/torch.h>

#include <algorithm>
#include <mutex>

#include "loom/error.h"

namespace loom::parallel {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// A generator's state at one moment, to be put back later.
struct GeneratorState {
  at::Generator generator;
  at::Tensor state;
};

GeneratorState capture(at::Generator generator) {
  std::lock_guard<std::mutex> lock(generator.mutex());
  at::Tensor state = generator.get_state();
  return {std::move(generator), std::move(state)};
}

void restore(const GeneratorState& saved) {
  at::Generator generator = saved.generator;
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(saved.state);
}

// The default CPU generator, and the default generator of every CUDA device an input is on.
std::vector<GeneratorState> capture_generators(const std::vector<at::Tensor>& inputs) {
  std::vector<GeneratorState> states{capture(at::detail::getDefaultCPUGenerator())};
  std::vector<at::Device> devices;
  for (const at::Tensor& input : inputs) {
    if (!input.is_cuda() || !at::globalContext().hasCUDA()) continue;
    if (std::find(devices.begin(), devices.end(), input.device()) != devices.end()) continue;
    devices.push_back(input.device());
    states.push_back(capture(at::globalContext().defaultGenerator(input.device())));
  }
  return states;
}

// RAII: the generators as they were in the checkpointed forward, for the recompute; the
// caller's states come back on destruction (also when the recompute throws).
class ReplayGenerators {
 public:
  explicit ReplayGenerators(const std::vector<GeneratorState>& forward) {
    for (const GeneratorState& saved : forward) {
      callers_.push_back(capture(saved.generator));
      restore(saved);
    }
  }
  ~ReplayGenerators() {
    for (const GeneratorState& saved : callers_) restore(saved);
  }
  ReplayGenerators(const ReplayGenerators&) = delete;
  ReplayGenerators& operator=(const ReplayGenerators&) = delete;

 private:
  std::vector<GeneratorState> callers_;
};

// What backward needs besides the saved inputs; lives in the autograd context as a capsule.
struct Recompute : torch::CustomClassHolder {
  CheckpointVectorFn fn;
  size_t inputs = 0;         // the caller's inputs
  bool placeholder = false;  // a trailing tensor that only makes the output require grad
  std::vector<GeneratorState> generators;
};

class CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
 public:
  // Runs under no-grad (Function::apply disables it): nothing of fn's graph is kept.
  static variable_list forward(AutogradContext* ctx, c10::intrusive_ptr<Recompute> recompute,
                               at::TensorList tensors) {
    std::vector<at::Tensor> inputs(
        tensors.begin(), tensors.begin() + static_cast<std::ptrdiff_t>(recompute->inputs));
    recompute->generators = capture_generators(inputs);
    ctx->save_for_backward(inputs);
    variable_list outputs = recompute->fn(inputs);
    ctx->saved_data["recompute"] = c10::IValue::make_capsule(std::move(recompute));
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto recompute =
        c10::static_intrusive_pointer_cast<Recompute>(ctx->saved_data["recompute"].toCapsule());
    const variable_list saved = ctx->get_saved_variables();
    std::vector<at::Tensor> detached;
    for (const at::Tensor& input : saved) {
      detached.push_back(input.detach().requires_grad_(input.requires_grad()));
    }
    variable_list outputs;
    {
      ReplayGenerators replay(recompute->generators);
      torch::AutoGradMode grad_on(true);
      outputs = recompute->fn(detached);
    }
    LOOM_CHECK(outputs.size() == grad_outputs.size(), InvalidArgument,
               "checkpoint: the recomputed function returned ", outputs.size(),
               " tensors, the checkpointed forward ", grad_outputs.size(),
               "; it must compute the same thing every time");
    variable_list roots, grads;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (!outputs[i].requires_grad() || !grad_outputs[i].defined()) continue;
      roots.push_back(outputs[i]);
      grads.push_back(grad_outputs[i]);
    }
    if (!roots.empty()) torch::autograd::backward(roots, grads);
    // One gradient per forward argument: none for the Recompute, the inputs', none for the
    // placeholder.
    variable_list result{at::Tensor()};
    for (const at::Tensor& input : detached) result.push_back(input.grad());
    if (recompute->placeholder) result.emplace_back();
    return result;
  }
};

}  // namespace

std::vector<at::Tensor> checkpoint(const CheckpointVectorFn& fn,
                                   const std::vector<at::Tensor>& inputs) {
  LOOM_CHECK(static_cast<bool>(fn), InvalidArgument, "checkpoint: the function is empty");
  for (size_t i = 0; i < inputs.size(); ++i) {
    LOOM_CHECK(inputs[i].defined(), InvalidArgument, "checkpoint: input ", i, " is undefined");
  }
  if (!torch::autograd::GradMode::is_enabled()) return fn(inputs);
  auto recompute = c10::make_intrusive<Recompute>();
  recompute->fn = fn;
  recompute->inputs = inputs.size();
  std::vector<at::Tensor> tensors = inputs;
  // When no input requires grad the function's output would not either, and the parameters
  // inside fn would get no gradient: a placeholder that requires grad makes the output require
  // it (the placeholder itself gets none).
  const bool any_requires_grad = std::any_of(inputs.begin(), inputs.end(),
                                             [](const at::Tensor& t) { return t.requires_grad(); });
  if (!any_requires_grad) {
    tensors.push_back(at::empty({0}).requires_grad_(true));
    recompute->placeholder = true;
  }
  return CheckpointFunction::apply(std::move(recompute), at::TensorList(tensors));
}

at::Tensor checkpoint(const CheckpointFn& fn, const at::Tensor& input) {
  LOOM_CHECK(static_cast<bool>(fn), InvalidArgument, "checkpoint: the function is empty");
  auto outputs = checkpoint(
      [fn](const std::vector<at::Tensor>& inputs) {
        return std::vector<at::Tensor>{fn(inputs[0])};
      },
      std::vector<at::Tensor>{input});
  return outputs[0];
}

// --- ActivationCheckpoint -------------------------------------------------------------------

ActivationCheckpointImpl::ActivationCheckpointImpl(torch::nn::AnyModule module)
    : any_(std::move(module)) {
  LOOM_CHECK(!any_.is_empty() && any_.ptr() != nullptr, InvalidArgument,
             "ActivationCheckpoint: the module to wrap is null (an empty holder, AnyModule or "
             "pointer)");
  inner_ = any_.ptr();
  // The wrapped module's registrations under their own names: see the header.
  for (const auto& item : inner_->named_parameters(/*recurse=*/false)) {
    register_parameter(item.key(), item.value(), item.value().requires_grad());
  }
  for (const auto& item : inner_->named_buffers(/*recurse=*/false)) {
    register_buffer(item.key(), item.value());
  }
  for (const auto& item : inner_->named_children()) register_module(item.key(), item.value());
}

at::Tensor ActivationCheckpointImpl::call(torch::nn::AnyModule& module, const at::Tensor& input) {
  torch::nn::AnyValue output = module.any_forward(input);
  if (auto* tensor = output.try_get<at::Tensor>()) return *tensor;
  throw InvalidArgument(loom::detail::concat("ActivationCheckpoint: the forward of ",
                                             module.ptr()->name(), " returned ",
                                             c10::demangle(output.type_info().name()),
                                             ", not a tensor; wrap a module with at::Tensor "
                                             "forward(at::Tensor)"));
}

at::Tensor ActivationCheckpointImpl::forward(const at::Tensor& input) {
  const bool any_parameter_requires_grad = [&] {
    for (const at::Tensor& p : parameters()) {
      if (p.requires_grad()) return true;
    }
    return false;
  }();
  // Nothing to differentiate: no graph would be built, so nothing to save either.
  if (!any_parameter_requires_grad && !input.requires_grad()) return call(any_, input);
  // The function holds (a copy of the AnyModule sharing) the module, not `this`: the graph may
  // outlive this wrapper.
  return checkpoint([module = any_](const at::Tensor& x) mutable { return call(module, x); },
                    input);
}

void ActivationCheckpointImpl::train(bool on) {
  Module::train(on);
  inner_->train(on);
}

void ActivationCheckpointImpl::to(torch::Device device, torch::Dtype dtype, bool non_blocking) {
  inner_->to(device, dtype, non_blocking);
}

void ActivationCheckpointImpl::to(torch::Dtype dtype, bool non_blocking) {
  inner_->to(dtype, non_blocking);
}

void ActivationCheckpointImpl::to(torch::Device device, bool non_blocking) {
  inner_->to(device, non_blocking);
}

void ActivationCheckpointImpl::pretty_print(std::ostream& stream) const {
  stream << "loom::parallel::ActivationCheckpoint(" << inner_->name() << ")";
}

void detail::replace_child(torch::nn::Module& parent, const torch::nn::Module& child,
                           std::shared_ptr<torch::nn::Module> replacement) {
  for (const auto& item : parent.named_children()) {
    if (item.value().get() != &child) continue;
    parent.replace_module(item.key(), std::move(replacement));
    return;
  }
  throw InvalidArgument(loom::detail::concat(
      "checkpoint_modules_of_type: the container (", child.name(), ") is not a direct child of ",
      parent.name(), "; pass the module that registered it"));
}

}  // namespace loom::parallel
