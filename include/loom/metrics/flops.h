// Model FLOPs utilisation (MFU): the FLOPs a model's training needs per token, and the peak
// FLOP/s of the device it runs on.
//
//   MFU = tokens/s * FLOPs per token / peak FLOP/s
//
// FLOPs per token count the matmul work of forward and backward (2 FLOPs per multiply-add,
// backward twice the forward); activation recomputation, optimizer and elementwise work are
// not counted, which is the convention of TorchTitan, Megatron and llm.c, so MFU figures
// compare across frameworks. See docs/metrics.md.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "loom/visibility.h"

namespace loom::metrics {

// The shape of a decoder-only transformer, for its FLOPs per token.
struct TransformerShape {
  int64_t params = 0;            // N: all trainable parameters (a tied weight counted once)
  int64_t embedding_params = 0;  // N_emb: parameters used only as table look-ups (see below)
  int64_t layers = 0;            // L
  int64_t heads = 0;             // H
  int64_t head_dim = 0;          // Q (H * Q is the model width C)
  int64_t seq_len = 0;           // T: the attention context the model trains at
};

// TorchTitan's formula: 6 (N - N_emb) + 12 L H Q T.
// 6 per parameter per token for the weight matmuls (forward 2, backward 4) and 12 L H Q T for
// attention's QK^T and AV products over the full T x T score matrix (causal masking is not
// discounted). N_emb are parameters that do no matmul: a token embedding table whose rows are
// gathered, and learned position embeddings. When the token embedding is tied to the output
// head it does a matmul (the logits), so then N_emb is the position embeddings only.
// Negative or zero fields other than embedding_params are InvalidArgument.
LOOM_API double flops_per_token(const TransformerShape& shape);

// llm.c's formula, for comparison: 6 N + 6 L C T with C = H Q. It counts every parameter
// (GPT-2 ties its embedding to the head, and llm.c also counts the position embeddings) and
// only the causal half of attention. For GPT-2 124M at T = 1024: 0.855 vs 0.803 GFLOP (6%).
LOOM_API double flops_per_token_llmc(const TransformerShape& shape);

// The peak FLOP/s MFU divides by, and where that figure came from.
struct PeakFlops {
  double flops_per_second = 0;
  std::string source;  // "measured-cpu-matmul" or "datasheet:<GPU>", e.g. "datasheet:H200"
};

struct CpuPeakOptions {
  int64_t min_n = 1024;  // square fp32 matmuls of min_n ... max_n (doubling)
  int64_t max_n = 2048;
  int repeats = 3;  // best of this many per size
};

// The best fp32 FLOP/s of torch::mm on the CPU, with torch's current intra-op thread count
// (set it first: Runtime does). Takes about half a second on 2 cores at the defaults.
LOOM_API PeakFlops measure_cpu_matmul_peak(const CpuPeakOptions& options = {});

// One row of the GPU datasheet table.
struct DatasheetEntry {
  std::string match;  // a device name containing this (cudaGetDeviceProperties' name) matches
  std::string label;  // in PeakFlops::source: "datasheet:<label>"
  double bf16_flops;  // dense bf16 tensor-core FLOP/s, no sparsity
};

// The table, most specific names first: H100 NVL 835e12, H100 PCIe 756e12, H100 (SXM) 989e12,
// H200 NVL 835e12, H200 (SXM) 989e12, B200 2.25e15, A100 312e12 (TorchTitan's figures).
LOOM_API const std::vector<DatasheetEntry>& datasheet_table();

// The first entry of datasheet_table() whose match is in `device_name`, e.g. "NVIDIA H200" ->
// {989e12, "datasheet:H200"}; nothing for another name ("Tesla T4", "").
LOOM_API std::optional<PeakFlops> datasheet_peak(const std::string& device_name);

// The name of CUDA device `index` (cudaGetDeviceProperties), or "" without CUDA support.
LOOM_API std::string cuda_device_name(int index);

struct MatmulPeakOptions {
  int64_t cpu_min_n = 1024;  // CPU: fp32 square matmuls of cpu_min_n ... cpu_max_n (doubling)
  int64_t cpu_max_n = 2048;
  int64_t cuda_n = 8192;  // CUDA: bf16 square matmuls of this size (8192: ~1.1 TFLOP each)
  int repeats = 3;        // best of this many (CUDA: after one warm-up)
};

// A measured matmul peak: on the CPU measure_cpu_matmul_peak (fp32); on a GPU the best bf16
// torch::mm FLOP/s timed with CUDA events on torch's current stream (source
// "measured-cuda-bf16-matmul"). InvalidArgument for other devices, and for cuda in a build
// without CUDA or with a libtorch that has none. Printed beside the datasheet figure, it says
// how far this machine (clocks, power cap, cuBLAS) is from the datasheet.
LOOM_API PeakFlops measure_matmul_peak(c10::Device device, const MatmulPeakOptions& options = {});
// The CUDA part of measure_matmul_peak (metrics/matmul_peak_cuda.cpp; without CUDA it throws).
LOOM_API PeakFlops measure_cuda_bf16_matmul_peak(int index, const MatmulPeakOptions& options);

// The peak MFU divides by: measured on the CPU; on a GPU the datasheet figure for its name,
// or, for a GPU not in the table, the measured bf16 matmul peak, with a source that says so
// ("measured-cuda-bf16-matmul (GPU 'Tesla T4' is not in the datasheet table)").
LOOM_API PeakFlops peak_flops(c10::Device device);

// peak_flops, measured once per job: the figure is kept in `cache` (a JSON file, e.g. in the run
// directory) with the device and torch's intra-op thread count, and read from it while they are
// the same, so that a restarted worker does not spend a second measuring again. A missing or
// unreadable cache is measured and (re)written, atomically; a cache that cannot be written is
// not an error (the figure is measured again next time).
LOOM_API PeakFlops peak_flops(c10::Device device, const std::filesystem::path& cache);

}  // namespace loom::metrics
