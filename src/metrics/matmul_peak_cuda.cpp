// The measured bf16 matmul peak of a GPU (compiled only with CUDA): torch::mm on bf16 CUDA
// tensors, timed with CUDA events on torch's current stream.
#include <cuda_runtime_api.h>
#include <torch/torch.h>

#include <algorithm>

#include "comm/cuda_check.h"
#include "comm/cuda_stream.h"
#include "loom/error.h"
#include "loom/metrics/flops.h"

namespace loom::metrics {
namespace {

// Owns one timing event.
class TimingEvent {
 public:
  TimingEvent() { LOOM_CHECK_CUDA(cudaEventCreate(&event_)); }
  ~TimingEvent() { cudaEventDestroy(event_); }
  TimingEvent(const TimingEvent&) = delete;
  TimingEvent& operator=(const TimingEvent&) = delete;
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

}  // namespace

PeakFlops measure_cuda_bf16_matmul_peak(int index, const MatmulPeakOptions& options) {
  LOOM_CHECK(options.cuda_n > 0 && options.repeats > 0, InvalidArgument,
             "MatmulPeakOptions: need cuda_n > 0 and repeats > 0");
  LOOM_CHECK(torch::cuda::is_available(), InvalidArgument,
             "measure_matmul_peak: this libtorch has no CUDA (or no GPU is visible); build Loom "
             "against a CUDA libtorch to measure a GPU");
  torch::NoGradGuard no_grad;
  const int64_t n = options.cuda_n;
  const auto on_gpu = torch::TensorOptions()
                          .dtype(torch::kBFloat16)
                          .device(torch::kCUDA, static_cast<c10::DeviceIndex>(index));
  const torch::Tensor a = torch::randn({n, n}, on_gpu);
  const torch::Tensor b = torch::randn({n, n}, on_gpu);
  torch::Tensor c = torch::mm(a, b);  // warm-up: cuBLAS handle, workspace, kernel choice
  LOOM_CHECK_CUDA(cudaSetDevice(index));
  const cudaStream_t stream = comm::current_compute_stream(index);
  TimingEvent start;
  TimingEvent stop;
  double best = 0;
  for (int r = 0; r < options.repeats; ++r) {
    LOOM_CHECK_CUDA(cudaEventRecord(start.get(), stream));
    torch::mm_out(c, a, b);
    LOOM_CHECK_CUDA(cudaEventRecord(stop.get(), stream));
    LOOM_CHECK_CUDA(cudaEventSynchronize(stop.get()));
    float ms = 0;
    LOOM_CHECK_CUDA(cudaEventElapsedTime(&ms, start.get(), stop.get()));
    const double seconds = std::max(static_cast<double>(ms) / 1e3, 1e-9);
    best = std::max(best, 2.0 * static_cast<double>(n) * static_cast<double>(n) *
                              static_cast<double>(n) / seconds);
  }
  return {best, "measured-cuda-bf16-matmul"};
}

}  // namespace loom::metrics
