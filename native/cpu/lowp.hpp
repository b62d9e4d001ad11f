// Scalar float <-> bf16/fp16 conversions, round-to-nearest-even, matching
// torch's `tensor.to(dtype)` bit for bit (including subnormals). NaN becomes
// 0xffff in bf16 (what torch's vectorised CPU conversion writes) and the
// quiet NaN 0x7e00 (with sign) in fp16.
#pragma once

#include <cstdint>
#include <cstring>

namespace infinity::cpu {

inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

inline uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0xffff;  // NaN
  // Add 0x7fff plus the lowest kept bit: ties go to the even neighbour.
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float f16_to_f32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (mant << 13));  // inf / NaN
  if (exp == 0) {
    // Subnormal (or zero): mant * 2^-24, exact in float.
    float v = static_cast<float>(mant) * bits_f32(0x33800000u);
    return sign ? -v : v;
  }
  return bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
}

inline uint16_t f32_to_f16(float f) {
  uint32_t u = f32_bits(f);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00;  // NaN
  if (a >= 0x477ff000u) return sign | 0x7c00;  // >= 65520 rounds to infinity
  if (a < 0x38800000u) {
    // Below the smallest normal half (2^-14): adding 0.5f aligns the value
    // to units of 2^-24 (one half subnormal step) with the FPU's
    // round-to-nearest-even; the excess over 0.5f is the half's bits.
    float t = bits_f32(a) + 0.5f;
    return static_cast<uint16_t>(sign | (f32_bits(t) - 0x3f000000u));
  }
  // Normal: rebias the exponent (127 -> 15) and round the mantissa to 10 bits.
  a += 0xc8000fffu + ((a >> 13) & 1u);  // 0xc8000000 = -(112 << 23) mod 2^32
  return static_cast<uint16_t>(sign | (a >> 13));
}

}  // namespace infinity::cpu
