// The fused AdamW kernel against its CPU reference, bitwise, over many tensors (several
// launches' worth of descriptors and blocks) and with the bf16 copy. Skipped without a GPU.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "adamw.h"

namespace loom::kernels {
namespace {

bool have_gpu() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

struct Host {
  std::vector<float> p, g, m, v;
  std::vector<uint16_t> bf16;
};

template <typename T>
T* to_device(const std::vector<T>& host) {
  T* device = nullptr;
  EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&device), host.size() * sizeof(T) + 4),
            cudaSuccess);
  EXPECT_EQ(cudaMemcpy(device, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
            cudaSuccess);
  return device;
}

template <typename T>
void to_host(std::vector<T>& host, const T* device) {
  EXPECT_EQ(cudaMemcpy(host.data(), device, host.size() * sizeof(T), cudaMemcpyDeviceToHost),
            cudaSuccess);
}

TEST(AdamWKernel, MatchesReferenceBitwiseOverManyTensors) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  // 30 tensors (more than one launch holds), one of 25M elements (more blocks than one launch).
  std::vector<int64_t> sizes = {0, 1, 511, 512, 513, 65535, 65536, 65537, 25'000'000};
  for (int i = 0; i < 21; ++i) sizes.push_back(1000 + 37 * i);
  std::mt19937 gen(11);
  std::normal_distribution<float> normal;
  std::vector<Host> hosts(sizes.size());
  for (size_t t = 0; t < sizes.size(); ++t) {
    Host& h = hosts[t];
    const size_t n = static_cast<size_t>(sizes[t]);
    h.p.resize(n);
    h.g.resize(n);
    h.m.resize(n);
    h.v.resize(n);
    h.bf16.assign(n, 0);
    for (size_t i = 0; i < n; ++i) {
      h.p[i] = normal(gen);
      h.g[i] = normal(gen);
      h.m[i] = 0.1f * normal(gen);
      h.v[i] = 0.01f * std::abs(normal(gen));
    }
  }
  for (bool with_bf16 : {false, true}) {
    const AdamWScalars s = adamw_scalars(3e-4, 0.9, 0.95, 1e-8, with_bf16 ? 0.1 : 0.0, 7);
    std::vector<Host> expected = hosts;
    std::vector<AdamWTensor> ref;
    std::vector<AdamWTensor> dev;
    for (size_t t = 0; t < sizes.size(); ++t) {
      Host& e = expected[t];
      ref.push_back({e.p.data(), e.g.data(), e.m.data(), e.v.data(),
                     with_bf16 ? e.bf16.data() : nullptr, sizes[t]});
      dev.push_back({to_device(hosts[t].p), to_device(hosts[t].g), to_device(hosts[t].m),
                     to_device(hosts[t].v), with_bf16 ? to_device(hosts[t].bf16) : nullptr,
                     sizes[t]});
    }
    adamw_ref(s, ref.data(), static_cast<int>(ref.size()));
    ASSERT_EQ(adamw(s, dev.data(), static_cast<int>(dev.size()), nullptr), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (size_t t = 0; t < sizes.size(); ++t) {
      Host got = hosts[t];
      to_host(got.p, dev[t].params);
      to_host(got.m, dev[t].exp_avg);
      to_host(got.v, dev[t].exp_avg_sq);
      if (with_bf16) to_host(got.bf16, dev[t].bf16_params);
      const size_t bytes = got.p.size() * sizeof(float);
      EXPECT_EQ(0, std::memcmp(got.p.data(), expected[t].p.data(), bytes)) << "params " << t;
      EXPECT_EQ(0, std::memcmp(got.m.data(), expected[t].m.data(), bytes)) << "exp_avg " << t;
      EXPECT_EQ(0, std::memcmp(got.v.data(), expected[t].v.data(), bytes)) << "exp_avg_sq " << t;
      EXPECT_EQ(0, std::memcmp(got.bf16.data(), expected[t].bf16.data(), got.bf16.size() * 2))
          << "bf16 " << t;
      cudaFree(dev[t].params);
      cudaFree(const_cast<float*>(dev[t].grads));
      cudaFree(dev[t].exp_avg);
      cudaFree(dev[t].exp_avg_sq);
      if (dev[t].bf16_params) cudaFree(dev[t].bf16_params);
    }
  }
}

}  // namespace
}  // namespace loom::kernels
