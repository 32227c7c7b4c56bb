// FLOPs per token formulas and peak FLOP/s: a measured CPU matmul or a GPU datasheet table.
#include "loom/metrics/flops.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>

#include "loom/error.h"

namespace loom::metrics {
namespace {

void check_shape(const TransformerShape& s) {
  LOOM_CHECK(s.params > 0 && s.layers > 0 && s.heads > 0 && s.head_dim > 0 && s.seq_len > 0,
             InvalidArgument,
             "TransformerShape needs positive params, layers, heads, head_dim and seq_len; got N=",
             s.params, " L=", s.layers, " H=", s.heads, " Q=", s.head_dim, " T=", s.seq_len);
  LOOM_CHECK(s.embedding_params >= 0 && s.embedding_params <= s.params, InvalidArgument,
             "TransformerShape::embedding_params must be in [0, params]; got ", s.embedding_params,
             " of ", s.params);
}

}  // namespace

double flops_per_token(const TransformerShape& s) {
  check_shape(s);
  return 6.0 * static_cast<double>(s.params - s.embedding_params) +
         12.0 * static_cast<double>(s.layers) * static_cast<double>(s.heads) *
             static_cast<double>(s.head_dim) * static_cast<double>(s.seq_len);
}

double flops_per_token_llmc(const TransformerShape& s) {
  check_shape(s);
  return 6.0 * static_cast<double>(s.params) + 6.0 * static_cast<double>(s.layers) *
                                                   static_cast<double>(s.heads * s.head_dim) *
                                                   static_cast<double>(s.seq_len);
}

PeakFlops measure_cpu_matmul_peak(const CpuPeakOptions& options) {
  LOOM_CHECK(options.min_n > 0 && options.max_n >= options.min_n && options.repeats > 0,
             InvalidArgument, "CpuPeakOptions: need 0 < min_n <= max_n and repeats > 0");
  torch::NoGradGuard no_grad;
  double best = 0;
  for (int64_t n = options.min_n; n <= options.max_n; n *= 2) {
    auto a = torch::randn({n, n});
    auto b = torch::randn({n, n});
    auto c = torch::mm(a, b);  // warm-up: thread pool, BLAS buffers
    for (int r = 0; r < options.repeats; ++r) {
      auto start = std::chrono::steady_clock::now();
      torch::mm_out(c, a, b);
      double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      best = std::max(best, 2.0 * static_cast<double>(n) * static_cast<double>(n) *
                                static_cast<double>(n) / std::max(seconds, 1e-9));
    }
  }
  return {best, "measured-cpu-matmul"};
}

std::optional<PeakFlops> datasheet_peak(const std::string& device_name) {
  // Dense bf16 peaks (no sparsity), as TorchTitan's utils.get_peak_flops lists them.
  struct Entry {
    const char* name;
    double flops;
  };
  static constexpr Entry kTable[] = {{"H200", 989e12}, {"H100", 989e12}, {"A100", 312e12}};
  for (const Entry& e : kTable) {
    if (device_name.find(e.name) != std::string::npos) {
      return PeakFlops{e.flops, std::string("datasheet:") + e.name};
    }
  }
  return std::nullopt;
}

PeakFlops peak_flops(c10::Device device) {
  if (device.is_cpu()) return measure_cpu_matmul_peak();
  LOOM_CHECK(device.is_cuda(), InvalidArgument, "peak_flops: no peak known for device ",
             device.str());
  const std::string name = cuda_device_name(device.has_index() ? device.index() : 0);
  std::optional<PeakFlops> peak = datasheet_peak(name);
  LOOM_CHECK(peak.has_value(), InvalidArgument, "peak_flops: GPU '", name,
             "' is not in the datasheet table (H200, H100, A100); pass its peak FLOP/s yourself");
  return *peak;
}

}  // namespace loom::metrics
