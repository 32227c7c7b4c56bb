// The fused AdamW reference (kernels/adamw_ref.h) against Loom's flat AdamW on ATen
// (loom::optim::AdamW on CPU tensors, itself bitwise torch::optim::AdamW), bit for bit. The
// GPU kernel is checked against this reference in tests/gpu/adamw_test.cpp, so the three agree.
//
// ATen fuses `a + alpha * b` and `a + s * b * c` into fused multiply-adds in its AVX2 and
// AVX-512 kernels, the ones it picks on any x86-64 CPU with AVX2; the reference fuses the same.
// With ATEN_CPU_CAPABILITY=default (no FMA) ATen rounds twice and the test is skipped.
#include "adamw_ref.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "loom/optim/flat_optimizer.h"
#include "scale_ref.h"

namespace loom::kernels {
namespace {

bool aten_uses_fma() {
  const char* capability = std::getenv("ATEN_CPU_CAPABILITY");
  return capability == nullptr || std::string(capability) != "default";
}

void expect_bitwise(const at::Tensor& got, const at::Tensor& expected, const std::string& what) {
  ASSERT_EQ(got.numel(), expected.numel()) << what;
  ASSERT_EQ(got.scalar_type(), expected.scalar_type()) << what;
  const int64_t n = got.numel();
  const size_t bytes = static_cast<size_t>(n) * got.element_size();
  if (bytes == 0 || std::memcmp(got.data_ptr(), expected.data_ptr(), bytes) == 0) return;
  const at::Tensor g = got.to(at::kDouble);
  const at::Tensor e = expected.to(at::kDouble);
  int64_t first = 0;
  while (first < n && g[first].item<double>() == e[first].item<double>()) ++first;
  ADD_FAILURE() << what << ": differs first at element " << first << " of " << n;
}

struct Case {
  int64_t n;
  double weight_decay;
};

// Five steps from the same state: ATen's flat AdamW vs the reference, every tensor every step.
TEST(AdamWRef, MatchesLoomsAtenAdamWBitwise) {
  if (!aten_uses_fma()) GTEST_SKIP() << "ATEN_CPU_CAPABILITY=default: ATen does not fuse";
  // Sizes with vector tails (15, 17), one over ATen's parallel grain (32768) with a tail.
  for (Case c :
       {Case{1, 0.01}, Case{15, 0.01}, Case{17, 0.0}, Case{4099, 0.1}, Case{100003, 0.01}}) {
    at::manual_seed(static_cast<uint64_t>(c.n));
    const optim::AdamWOptions options{.lr = 3e-3, .weight_decay = c.weight_decay};
    const optim::AdamW aten(options);
    at::Tensor p_aten = at::randn({c.n});
    std::vector<at::Tensor> s_aten = {at::zeros({c.n}), at::zeros({c.n})};
    at::Tensor p_ref = p_aten.clone();
    at::Tensor m_ref = at::zeros({c.n});
    at::Tensor v_ref = at::zeros({c.n});
    at::Tensor bf16_ref = at::empty({c.n}, at::kBFloat16);
    for (int64_t step = 1; step <= 5; ++step) {
      const at::Tensor grad = at::randn({c.n}) * (step == 3 ? 1e-4 : 1.0);
      aten.update(p_aten, grad, s_aten, step);
      const AdamWScalars scalars = adamw_scalars(options.lr, options.beta1, options.beta2,
                                                 options.eps, options.weight_decay, step);
      AdamWTensor tensor{p_ref.data_ptr<float>(),
                         grad.data_ptr<float>(),
                         m_ref.data_ptr<float>(),
                         v_ref.data_ptr<float>(),
                         static_cast<uint16_t*>(bf16_ref.data_ptr()),
                         c.n};
      adamw_ref(scalars, &tensor, 1);
      const std::string what = "n " + std::to_string(c.n) + " step " + std::to_string(step);
      expect_bitwise(m_ref, s_aten[0], what + " exp_avg");
      expect_bitwise(v_ref, s_aten[1], what + " exp_avg_sq");
      expect_bitwise(p_ref, p_aten, what + " params");
      expect_bitwise(bf16_ref, p_aten.to(at::kBFloat16), what + " bf16 params");
    }
  }
}

TEST(AdamWRef, ScalarsAreTheDoubleExpressionsRoundedOnce) {
  const AdamWScalars s = adamw_scalars(1e-3, 0.9, 0.95, 1e-8, 0.1, 3);
  EXPECT_TRUE(s.decay);
  EXPECT_EQ(s.decay_factor, static_cast<float>(1 - 1e-3 * 0.1));
  EXPECT_EQ(s.beta1, 0.9f);
  EXPECT_EQ(s.one_minus_beta1, static_cast<float>(1 - 0.9));
  EXPECT_EQ(s.beta2, 0.95f);
  EXPECT_EQ(s.one_minus_beta2, static_cast<float>(1 - 0.95));
  EXPECT_EQ(s.sqrt_bias_correction2, static_cast<float>(std::sqrt(1 - std::pow(0.95, 3.0))));
  EXPECT_EQ(s.eps, 1e-8f);
  EXPECT_EQ(s.neg_step_size, static_cast<float>(-(1e-3 / (1 - std::pow(0.9, 3.0)))));
  EXPECT_FALSE(adamw_scalars(1e-3, 0.9, 0.95, 1e-8, 0.0, 1).decay);
}

// Several tensors in one call are the same as one call each; a null bf16 pointer writes none.
TEST(AdamWRef, MultiTensorEqualsOneTensorAtATime) {
  at::manual_seed(5);
  const std::vector<int64_t> sizes = {3, 0, 70000, 1};
  const AdamWScalars s = adamw_scalars(1e-2, 0.9, 0.999, 1e-8, 0.01, 2);
  std::vector<at::Tensor> p, g, m, v, p1, m1, v1;
  std::vector<AdamWTensor> together;
  for (int64_t n : sizes) {
    p.push_back(at::randn({n}));
    g.push_back(at::randn({n}));
    m.push_back(at::randn({n}) * 0.1);
    v.push_back(at::rand({n}) * 0.01);
    p1.push_back(p.back().clone());
    m1.push_back(m.back().clone());
    v1.push_back(v.back().clone());
  }
  for (size_t i = 0; i < sizes.size(); ++i) {
    together.push_back({p[i].data_ptr<float>(), g[i].data_ptr<float>(), m[i].data_ptr<float>(),
                        v[i].data_ptr<float>(), nullptr, sizes[i]});
  }
  adamw_ref(s, together.data(), static_cast<int>(together.size()));
  for (size_t i = 0; i < sizes.size(); ++i) {
    AdamWTensor one{p1[i].data_ptr<float>(),
                    g[i].data_ptr<float>(),
                    m1[i].data_ptr<float>(),
                    v1[i].data_ptr<float>(),
                    nullptr,
                    sizes[i]};
    adamw_ref(s, &one, 1);
    expect_bitwise(p[i], p1[i], "params " + std::to_string(i));
    expect_bitwise(m[i], m1[i], "exp_avg " + std::to_string(i));
    expect_bitwise(v[i], v1[i], "exp_avg_sq " + std::to_string(i));
  }
}

TEST(Bf16Rounding, NearestEvenAsAten) {
  const at::Tensor x = at::randn({10000}) * 100;
  const at::Tensor expected = x.to(at::kBFloat16);
  for (int64_t i = 0; i < x.numel(); ++i) {
    uint16_t want;
    std::memcpy(&want, static_cast<const char*>(expected.data_ptr()) + 2 * i, 2);
    ASSERT_EQ(float_to_bf16(x.data_ptr<float>()[i]), want) << "element " << i;
  }
  EXPECT_EQ(bf16_to_float(float_to_bf16(1.5f)), 1.5f);
}

}  // namespace
}  // namespace loom::kernels
