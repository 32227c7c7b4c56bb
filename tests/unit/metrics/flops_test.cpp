// FLOPs per token against hand-computed values; the peak table and the CPU measurement.
#include "loom/metrics/flops.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "loom/error.h"

namespace loom::metrics {
namespace {

// GPT-2 124M: V = 50257, T = 1024, L = 12, H = 12, Q = 64, C = 768, tied head.
TransformerShape gpt2_124m() {
  const int64_t V = 50257, T = 1024, L = 12, C = 768;
  const int64_t per_layer = 12 * C * C + 13 * C;  // qkv, proj, fc, fc_proj weights+biases, 2 LN
  const int64_t params = V * C + T * C + L * per_layer + 2 * C;
  return {.params = params,
          .embedding_params = T * C,
          .layers = L,
          .heads = 12,
          .head_dim = 64,
          .seq_len = T};
}

TEST(Flops, TorchTitanFormulaByHand) {
  TransformerShape s{.params = 1000,
                     .embedding_params = 100,
                     .layers = 2,
                     .heads = 4,
                     .head_dim = 8,
                     .seq_len = 16};
  // 6 * 900 + 12 * 2 * 4 * 8 * 16 = 5400 + 12288
  EXPECT_DOUBLE_EQ(flops_per_token(s), 17688.0);
  // 6 * 1000 + 6 * 2 * 32 * 16 = 6000 + 6144
  EXPECT_DOUBLE_EQ(flops_per_token_llmc(s), 12144.0);
}

TEST(Flops, Gpt2SmallIsAboutOneGigaflopPerTokenByBothFormulas) {
  const TransformerShape s = gpt2_124m();
  EXPECT_EQ(s.params, 124439808);  // the published count of GPT-2 small (tied head)
  const double titan = flops_per_token(s);
  const double llmc = flops_per_token_llmc(s);
  EXPECT_DOUBLE_EQ(titan, 6.0 * (124439808 - 786432) + 12.0 * 12 * 12 * 64 * 1024);
  EXPECT_NEAR(titan / 1e9, 0.8550, 1e-3);
  EXPECT_NEAR(llmc / 1e9, 0.8033, 1e-3);
}

TEST(Flops, BadShapesAreInvalidArgument) {
  EXPECT_THROW(flops_per_token({}), InvalidArgument);
  EXPECT_THROW(flops_per_token({.params = 10,
                                .embedding_params = 11,
                                .layers = 1,
                                .heads = 1,
                                .head_dim = 1,
                                .seq_len = 1}),
               InvalidArgument);
}

TEST(Flops, DatasheetPeaksByDeviceName) {
  // The names cudaGetDeviceProperties reports, and the dense bf16 peak each must get.
  struct Case {
    const char* name;
    double flops;
    const char* source;
  };
  for (const Case& c : {Case{"NVIDIA H200", 989e12, "datasheet:H200"},
                        Case{"NVIDIA H200 NVL", 835e12, "datasheet:H200 NVL"},
                        Case{"NVIDIA H100 80GB HBM3", 989e12, "datasheet:H100"},
                        Case{"NVIDIA H100 PCIe", 756e12, "datasheet:H100 PCIe"},
                        Case{"NVIDIA H100 NVL", 835e12, "datasheet:H100 NVL"},
                        Case{"NVIDIA B200", 2.25e15, "datasheet:B200"},
                        Case{"NVIDIA A100-SXM4-40GB", 312e12, "datasheet:A100"},
                        Case{"NVIDIA A100 80GB PCIe", 312e12, "datasheet:A100"}}) {
    const auto peak = datasheet_peak(c.name);
    ASSERT_TRUE(peak.has_value()) << c.name;
    EXPECT_EQ(peak->flops_per_second, c.flops) << c.name;
    EXPECT_EQ(peak->source, c.source) << c.name;
  }
  EXPECT_FALSE(datasheet_peak("Tesla T4").has_value());
  EXPECT_FALSE(datasheet_peak("").has_value());
}

TEST(Flops, DatasheetTablePutsSpecificNamesBeforeTheirPrefixes) {
  const auto& table = datasheet_table();
  for (size_t i = 0; i < table.size(); ++i) {
    for (size_t j = i + 1; j < table.size(); ++j) {
      EXPECT_EQ(table[j].match.find(table[i].match), std::string::npos)
          << "'" << table[j].match << "' can never match: '" << table[i].match << "' comes first";
    }
  }
}

TEST(Flops, MeasuredPeakOnTheCpuIsTheCpuMatmul) {
  const PeakFlops peak =
      measure_matmul_peak(c10::Device(c10::kCPU), {.cpu_min_n = 128, .cpu_max_n = 128});
  EXPECT_EQ(peak.source, "measured-cpu-matmul");
  EXPECT_GT(peak.flops_per_second, 1e8);
  EXPECT_THROW(measure_matmul_peak(c10::Device(c10::kMeta)), InvalidArgument);
}

TEST(Flops, CpuPeakIsMeasuredWithAMatmul) {
  const PeakFlops peak = measure_cpu_matmul_peak({.min_n = 128, .max_n = 256, .repeats = 2});
  EXPECT_EQ(peak.source, "measured-cpu-matmul");
  // Anything from Debian's reference BLAS (a few GFLOP/s) to a large server.
  EXPECT_GT(peak.flops_per_second, 1e8);
  EXPECT_LT(peak.flops_per_second, 1e14);
  EXPECT_EQ(peak_flops(c10::Device(c10::kCPU)).source, "measured-cpu-matmul");
  EXPECT_THROW(measure_cpu_matmul_peak({.min_n = 0}), InvalidArgument);
}

}  // namespace
}  // namespace loom::metrics
