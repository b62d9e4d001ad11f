// Scalar float <-> bf16/fp16 conversions, round-to-nearest-even, matching
// torch's `tensor.to(dtype)` bit for bit (including subnormals). NaN becomes
// 0xffff in bf16 (what torch's vectorised CPU conversion writes) and, in fp16,
// what F16C's VCVTPS2PH (the SIMD paths' conversion) makes of it: sign, all-ones
// exponent, the quiet bit, and the top 9 bits of the payload.
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

// [Note: bf16 moments round as VCVTNE2PS2BF16 does]
// bf16 Adam moments (nearest) are rounded as AVX512_BF16's conversion rounds:
// to nearest even, with subnormal inputs flushed to zero of their sign, and a
// NaN quieted with the top of its payload kept (checked against the
// instruction for all 2^32 inputs). The instruction converts 32 values at
// once; every other path (scalar, AVX2, AVX-512 without it) does this same
// arithmetic, so all paths store the same bits. A subnormal moment (below
// 1.2e-38) counts for nothing beside eps = 1e-8, so the flush changes no
// update that matters. The parameter copy (f32_to_bf16) keeps torch's rounding.
inline uint16_t f32_to_bf16_flush(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN, quieted
  if ((u & 0x7f800000u) == 0) return static_cast<uint16_t>((u >> 16) & 0x8000u);       // zero, subnormal
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
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x1ffu));  // NaN
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
