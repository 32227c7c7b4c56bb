// A parameter's .grad() as a view of a strategy's flat gradient buffer, shared by DataParallel
// and FSDP. Private to src/parallel/.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/grad_mode.h>

namespace loom::parallel::internal {

// Makes `view` (the parameter's slice of a flat gradient buffer) its .grad(), given `grad`, what
// autograd accumulated (the .grad() it found). When that is another tensor (a user replaced
// .grad(), so accumulation started afresh there) its values move into the view; when it is
// undefined the view is zeroed.
inline void adopt_gradient(at::Tensor& param, const at::Tensor& grad, const at::Tensor& view) {
  if (grad.defined() && grad.data_ptr() == view.data_ptr()) {
    if (!param.grad().is_same(view)) param.mutable_grad() = view;
    return;
  }
  at::NoGradGuard no_grad;
  if (grad.defined()) {
    view.copy_(grad);
  } else {
    view.zero_();
  }
  param.mutable_grad() = view;
}

}  // namespace loom::parallel::internal
