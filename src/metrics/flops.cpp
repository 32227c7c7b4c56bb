// FLOPs per token formulas and peak FLOP/s: a measured CPU matmul, a GPU datasheet table, and
// the dispatch to a measured GPU matmul (metrics/matmul_peak_cuda.cpp).
#include "loom/metrics/flops.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <nlohmann/json.hpp>
#include <vector>

#include "loom/error.h"
#include "util/files.h"

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

const std::vector<DatasheetEntry>& datasheet_table() {
  // Dense bf16 tensor-core peaks (no sparsity) from NVIDIA's datasheets; the figures and the
  // variant rules are TorchTitan's utils.get_peak_flops. More specific names come first: the
  // first entry whose `match` is in the device name wins.
  static const std::vector<DatasheetEntry> kTable = {
      {"H100 NVL", "H100 NVL", 835e12}, {"H100 PCIe", "H100 PCIe", 756e12},
      {"H100", "H100", 989e12},         {"H200 NVL", "H200 NVL", 835e12},
      {"H200", "H200", 989e12},         {"B200", "B200", 2.25e15},
      {"A100", "A100", 312e12},
  };
  return kTable;
}

std::optional<PeakFlops> datasheet_peak(const std::string& device_name) {
  for (const DatasheetEntry& e : datasheet_table()) {
    if (device_name.find(e.match) != std::string::npos) {
      return PeakFlops{e.bf16_flops, "datasheet:" + e.label};
    }
  }
  return std::nullopt;
}

PeakFlops measure_matmul_peak(c10::Device device, const MatmulPeakOptions& options) {
  if (device.is_cpu()) {
    return measure_cpu_matmul_peak(
        {.min_n = options.cpu_min_n, .max_n = options.cpu_max_n, .repeats = options.repeats});
  }
  LOOM_CHECK(device.is_cuda(), InvalidArgument, "measure_matmul_peak: no matmul peak for device ",
             device.str(), "; use cpu or cuda");
  return measure_cuda_bf16_matmul_peak(device.has_index() ? device.index() : 0, options);
}

PeakFlops peak_flops(c10::Device device) {
  if (device.is_cpu()) return measure_cpu_matmul_peak();
  LOOM_CHECK(device.is_cuda(), InvalidArgument, "peak_flops: no peak known for device ",
             device.str(), "; MFU is defined for cpu and cuda devices");
  const int index = device.has_index() ? device.index() : 0;
  const std::string name = cuda_device_name(index);
  if (std::optional<PeakFlops> peak = datasheet_peak(name)) return *peak;
  // Not in the table: a measured peak, and the source says why it is not the datasheet's.
  PeakFlops measured = measure_cuda_bf16_matmul_peak(index, {});
  measured.source += " (GPU '" + name + "' is not in the datasheet table)";
  return measured;
}

PeakFlops peak_flops(c10::Device device, const std::filesystem::path& cache) {
  const nlohmann::json key = {{"device", device.str()}, {"threads", at::get_num_threads()}};
  try {
    const nlohmann::json j = nlohmann::json::parse(util::read_file(cache));
    if (j.at("key") == key) {
      return {j.at("flops_per_second").get<double>(), j.at("source").get<std::string>()};
    }
  } catch (const std::exception&) {
    // none yet, another device or thread count, or unreadable: measure
  }
  const PeakFlops peak = peak_flops(device);
  try {
    const nlohmann::json j = {
        {"key", key}, {"flops_per_second", peak.flops_per_second}, {"source", peak.source}};
    util::write_file_atomic(cache, j.dump() + "\n");
  } catch (const std::exception&) {
    // a read-only run directory: measured again next time
  }
  return peak;
}

}  // namespace loom::metrics
