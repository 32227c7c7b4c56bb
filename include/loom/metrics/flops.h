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
#include <optional>
#include <string>

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
double flops_per_token(const TransformerShape& shape);

// llm.c's formula, for comparison: 6 N + 6 L C T with C = H Q. It counts every parameter
// (GPT-2 ties its embedding to the head, and llm.c also counts the position embeddings) and
// only the causal half of attention. For GPT-2 124M at T = 1024: 0.855 vs 0.803 GFLOP (6%).
double flops_per_token_llmc(const TransformerShape& shape);

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
PeakFlops measure_cpu_matmul_peak(const CpuPeakOptions& options = {});

// The dense bf16 datasheet peak for a GPU whose name contains H200, H100 or A100 (989e12,
// 989e12, 312e12: TorchTitan's table), or nothing for another name.
std::optional<PeakFlops> datasheet_peak(const std::string& device_name);

// The name of CUDA device `index` (cudaGetDeviceProperties), or "" without CUDA support.
std::string cuda_device_name(int index);

// The peak for `device`: measured on the CPU; on a GPU the datasheet figure for its name.
// A GPU not in the table is InvalidArgument naming it (pass a peak of your own instead).
PeakFlops peak_flops(c10::Device device);

}  // namespace loom::metrics
