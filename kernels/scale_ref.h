// CPU references of the scale kernels (scale.h), compiled in every build so that the CPU tests
// can check them; bit-exact with the CUDA kernels.
#pragma once

#include <cstdint>

namespace loom::kernels {

// data[i] *= factor for i in [0, n).
void scale_f32_ref(float* data, int64_t n, float factor);
// bf16 stored as raw uint16 bits; the product is computed in fp32 and rounded to nearest even.
void scale_bf16_ref(uint16_t* data, int64_t n, float factor);

// fp32 -> bf16 bits, rounded to nearest even (NaN stays a quiet NaN), as __float2bfloat16_rn.
uint16_t float_to_bf16(float value);
float bf16_to_float(uint16_t bits);

}  // namespace loom::kernels
