// device_kernels.h with CUDA: checks the tensors and launches kernels/adamw.cu and
// kernels/sum_squares.cu on torch's current stream of the tensors' device.
#include "optim/device_kernels.h"

#include <ATen/ATen.h>

#include <string>

#include "adamw.h"
#include "comm/cuda_check.h"
#include "comm/cuda_stream.h"
#include "loom/error.h"
#include "sum_squares.h"
#include "util/dtype.h"

namespace loom::optim::internal {
namespace {

void check_buffer(const char* op, const char* what, const at::Tensor& t, at::ScalarType dtype,
                  const at::Tensor& reference) {
  LOOM_CHECK(t.defined() && t.is_cuda() && t.scalar_type() == dtype && t.is_contiguous() &&
                 t.device() == reference.device() && t.numel() == reference.numel(),
             InvalidArgument, op, ": ", what, " must be a contiguous ", util::dtype_name(dtype),
             " tensor of ", reference.numel(), " elements on ", reference.device().str(), "; got ",
             t.defined()
                 ? detail::concat(util::dtype_name(t.scalar_type()), "[", t.numel(), "] on ",
                                  t.device().str(), t.is_contiguous() ? "" : " (strided)")
                 : std::string("an undefined tensor"));
}

}  // namespace

void fused_adamw(const AdamWStep& step, const at::Tensor& params, const at::Tensor& grads,
                 const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                 const at::Tensor& bf16_params) {
  check_buffer("fused AdamW", "params", params, at::kFloat, params);
  check_buffer("fused AdamW", "grads", grads, at::kFloat, params);
  check_buffer("fused AdamW", "exp_avg", exp_avg, at::kFloat, params);
  check_buffer("fused AdamW", "exp_avg_sq", exp_avg_sq, at::kFloat, params);
  if (bf16_params.defined()) {
    check_buffer("fused AdamW", "bf16_params", bf16_params, at::kBFloat16, params);
  }
  kernels::AdamWTensor tensor;
  tensor.params = params.data_ptr<float>();
  tensor.grads = grads.data_ptr<float>();
  tensor.exp_avg = exp_avg.data_ptr<float>();
  tensor.exp_avg_sq = exp_avg_sq.data_ptr<float>();
  tensor.bf16_params =
      bf16_params.defined() ? static_cast<uint16_t*>(bf16_params.data_ptr()) : nullptr;
  tensor.n = params.numel();
  const kernels::AdamWScalars scalars = kernels::adamw_scalars(
      step.lr, step.beta1, step.beta2, step.eps, step.weight_decay, step.step);
  const int device = params.get_device();
  LOOM_CHECK_CUDA(cudaSetDevice(device));
  LOOM_CHECK_CUDA(kernels::adamw(scalars, &tensor, 1, comm::current_compute_stream(device)));
}

at::Tensor fused_sum_of_squares(const std::vector<at::Tensor>& tensors) {
  LOOM_CHECK(!tensors.empty(), InvalidArgument, "fused sum of squares: no tensors");
  std::vector<kernels::SquaresTensor> views;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    LOOM_CHECK(t.is_cuda() && t.scalar_type() == at::kFloat && t.is_contiguous() &&
                   t.device() == tensors[0].device(),
               InvalidArgument, "fused sum of squares: tensors[", i,
               "] must be a contiguous float32 tensor on ", tensors[0].device().str(), "; got ",
               util::dtype_name(t.scalar_type()), " on ", t.device().str());
    views.push_back({t.data_ptr<float>(), t.numel()});
  }
  const int count = static_cast<int>(views.size());
  const int64_t chunks = kernels::sum_squares_chunks(views.data(), count);
  const auto options = tensors[0].options().dtype(at::kDouble);
  at::Tensor workspace = at::empty({chunks > 0 ? chunks : 1}, options);
  at::Tensor out = at::empty({1}, options);
  const int device = tensors[0].get_device();
  LOOM_CHECK_CUDA(cudaSetDevice(device));
  // The workspace goes back to torch's caching allocator on this stream, after the kernels.
  LOOM_CHECK_CUDA(kernels::sum_squares(views.data(), count, workspace.data_ptr<double>(),
                                       out.data_ptr<double>(),
                                       comm::current_compute_stream(device)));
  return out;
}

}  // namespace loom::optim::internal
