// CPU references for scale.h, bit-exact with the CUDA kernels.
#include "scale_ref.h"

#include <cstring>

namespace loom::kernels {

float bf16_to_float(uint16_t bits) {
  uint32_t word = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &word, sizeof(value));
  return value;
}

uint16_t float_to_bf16(float value) {
  uint32_t word;
  std::memcpy(&word, &value, sizeof(word));
  if ((word & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((word >> 16) | 0x40u);
  uint32_t rounding = 0x7fffu + ((word >> 16) & 1u);
  return static_cast<uint16_t>((word + rounding) >> 16);
}

void scale_f32_ref(float* data, int64_t n, float factor) {
  for (int64_t i = 0; i < n; ++i) data[i] *= factor;
}

void scale_bf16_ref(uint16_t* data, int64_t n, float factor) {
  for (int64_t i = 0; i < n; ++i) data[i] = float_to_bf16(bf16_to_float(data[i]) * factor);
}

}  // namespace loom::kernels
