// CPU Adam/AdamW over flat buffers: fp32 master weights, moments in fp32,
// bf16 or 8-bit blocks, grads in fp32/bf16/fp16, optional bf16/fp16 copy of the new weights,
// gradient unscaling and an inf/nan check, in one sweep over the optimizer
// state.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "simd.hpp"

namespace infinity::cpu {

enum class Dtype { kF32 = 0, kBF16 = 1, kF16 = 2, kI8 = 3 };  // kI8: 8-bit moments only

// 8-bit moments ([Note: 8-bit moments] in infinity/optim/moments8.py): one fp32 power-of-two scale per
// kMomentBlock elements, blocks counted from element 0. exp_avg's codes are a sign and E4M3, exp_avg_sq's
// are sqrt(v) in E4M4.
constexpr size_t kMomentBlock = 256;

// How bf16 moments are rounded when stored (see [Note: bf16 moments]).
enum class Rounding { kNearest = 0, kStochastic = 1 };

struct AdamArgs {
  float* param = nullptr;
  const void* grad = nullptr;
  Dtype grad_dtype = Dtype::kF32;
  void* exp_avg = nullptr;       // fp32, bf16 with moment_dtype kBF16, or the uint8 codes with kI8
  void* exp_avg_sq = nullptr;
  float* exp_avg_scale = nullptr;     // kI8: the blocks' scales (ceil(n / kMomentBlock) each)
  float* exp_avg_sq_scale = nullptr;
  Dtype moment_dtype = Dtype::kF32;  // kF32, kBF16 or kI8
  Rounding moment_rounding = Rounding::kNearest;  // bf16 and 8-bit moments
  uint32_t moment_seed = 0;     // kStochastic: element i's bits are moment_bits(moment_seed, i)
  void* out_lowp = nullptr;  // null: no low-precision copy
  Dtype lowp_dtype = Dtype::kBF16;
  size_t n = 0;
  int64_t step = 1;  // 1 on the first update
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
  bool adamw = true;            // decoupled weight decay; false: L2 added to the grad
  bool bias_correction = true;
  double grad_scale = 1.0;      // grads are divided by this first
  bool check_finite = true;     // scan grads first; skip the step on inf/nan
};

// Per-step constants, rounded to float the way torch rounds its Python
// scalars when it applies them to float tensors.
struct AdamScalars {
  float inv_scale;  // 1 / grad_scale
  float decay;      // 1 - lr * weight_decay (AdamW), else 1
  float l2;         // weight_decay (Adam), else 0
  float w1;         // lerp weight 1 - beta1
  bool lerp_low;    // torch's lerp takes the other formula when w1 >= 0.5
  float beta2;
  float c2;         // 1 - beta2
  float bc2_sqrt;   // sqrt(1 - beta2^step), or 1
  float inv_bc2_sqrt;  // 1 / bc2_sqrt: bf16 moments multiply where torch divides (one division less)
  float eps;
  float neg_step;   // -lr / (1 - beta1^step)
};

AdamScalars adam_scalars(const AdamArgs& a);

// The random bits stochastic rounding adds below a bf16 moment's kept bits:
// a counter-based hash of (seed, element index), so the result is the same
// whatever the thread split or SIMD width. The low 16 bits round exp_avg,
// the high 16 exp_avg_sq. Every SIMD path computes exactly this.
inline uint32_t moment_bits(uint32_t seed, uint32_t i) {
  uint32_t x = (i * 0x9e3779b1u) ^ seed;
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// fp32 -> bf16 with `r` (< 2^16) added below the kept bits: stochastic
// rounding, up with probability (dropped bits) / 2^16. NaN becomes 0xffff.
inline uint16_t f32_to_bf16_stochastic(uint32_t u, uint32_t r) {
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0xffff;
  return static_cast<uint16_t>((u + r) >> 16);
}

// The 8-bit moment codes, one element at a time: the reference every SIMD path matches bit for bit.
// M mantissa bits (3 for exp_avg, 4 for exp_avg_sq), 4 exponent bits; `top` the largest magnitude code.
// `e` is the block's biased exponent (its scale's bits >> 23), at least kExpFloor[M == 4]: 16 for exp_avg
// (every decoded value a normal float), 79 for exp_avg_sq's sqrt(v), so that u * u of its smallest nonzero
// code is still a normal float and v = u * u is exact.
inline uint32_t block_exponent(uint32_t peak_bits, uint32_t floor) {
  uint32_t e = peak_bits >> 23;
  return e < floor ? floor : e;
}
constexpr uint32_t kExpFloorM = 16, kExpFloorV = 79;

template <int M>
inline float decode8(uint32_t code, uint32_t e) {
  constexpr uint32_t top = (1u << (4 + M)) - 1;
  const uint32_t mag = code & top;
  uint32_t bits = mag == 0 ? 0 : (mag + ((e - 15) << M)) << (23 - M);
  if (M == 3) bits |= (code >> 7) << 31;  // exp_avg's sign
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// `r` is added below the kept bits before they are cut: stochastic (16 random bits << (7 - M)) or, when
// `nearest`, the round-to-nearest-even addend computed here.
template <int M>
inline uint32_t encode8(float x, uint32_t e, uint32_t r, bool nearest) {
  constexpr uint32_t top = (1u << (4 + M)) - 1;
  constexpr int cut = 23 - M;
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  const uint32_t a = bits & 0x7fffffffu;
  if (nearest) r = ((1u << (cut - 1)) - 1) + ((a >> cut) & 1u);
  int32_t q = static_cast<int32_t>((a + r) >> cut) - static_cast<int32_t>((e - 15) << M);
  q = q < 0 ? 0 : q > static_cast<int32_t>(top) ? static_cast<int32_t>(top) : q;
  uint32_t code = static_cast<uint32_t>(q);
  if (M == 3) code |= (bits >> 31) << 7;
  return code;
}

// True when any grad[i] * inv_scale is inf/nan; a read-only parallel sweep.
bool any_nonfinite(const void* grad, Dtype dt, size_t n, float inv_scale, SimdLevel level);

// Runs one step. Returns true when a gradient was inf/nan after unscaling:
// then no buffer was written (needs check_finite). `level` picks the code path.
bool adam_step(const AdamArgs& a, SimdLevel level);

// Kernels over [lo, hi), one per code path. They update whatever the gradients
// hold: the inf/nan verdict is adam_step's read-only sweep before them.
void adam_range_scalar(const AdamArgs& a, const AdamScalars& s, size_t lo, size_t hi);
// One block of 8-bit moments (lo a multiple of kMomentBlock, hi - lo <= kMomentBlock): the reference, and
// what the SIMD paths call for a last, partial block.
void adam_block8_scalar(const AdamArgs& a, const AdamScalars& s, size_t lo, size_t hi);
void adam_range_avx2(const AdamArgs& a, const AdamScalars& s, size_t lo, size_t hi);
void adam_range_avx512(const AdamArgs& a, const AdamScalars& s, size_t lo, size_t hi);
void adam_range_avx512bf16(const AdamArgs& a, const AdamScalars& s, size_t lo, size_t hi);
bool nonfinite_scalar(const void* grad, Dtype dt, float inv_scale, size_t lo, size_t hi);
bool nonfinite_avx2(const void* grad, Dtype dt, float inv_scale, size_t lo, size_t hi);
bool nonfinite_avx512(const void* grad, Dtype dt, float inv_scale, size_t lo, size_t hi);
bool nonfinite_avx512bf16(const void* grad, Dtype dt, float inv_scale, size_t lo, size_t hi);

// The roofline reference: Adam's memory traffic (read p, g, m, v; write p, m,
// v; optionally a 2-byte copy) with trivial arithmetic. Returns elapsed seconds.
double stream_adam_traffic(float* p, const float* g, float* m, float* v, uint16_t* lowp, size_t n, int repeats);

}  // namespace infinity::cpu
