// CPU Adam/AdamW over flat buffers: fp32 master weights, moments in fp32 or
// bf16, grads in fp32/bf16/fp16, optional bf16/fp16 copy of the new weights,
// gradient unscaling and an inf/nan check, in one sweep over the optimizer
// state.
#pragma once

#include <cstddef>
#include <cstdint>

#include "simd.hpp"

namespace infinity::cpu {

enum class Dtype { kF32 = 0, kBF16 = 1, kF16 = 2 };

// How bf16 moments are rounded when stored (see [Note: bf16 moments]).
enum class Rounding { kNearest = 0, kStochastic = 1 };

struct AdamArgs {
  float* param = nullptr;
  const void* grad = nullptr;
  Dtype grad_dtype = Dtype::kF32;
  void* exp_avg = nullptr;       // fp32, or bf16 with moment_dtype kBF16
  void* exp_avg_sq = nullptr;
  Dtype moment_dtype = Dtype::kF32;  // kF32 or kBF16
  Rounding moment_rounding = Rounding::kNearest;  // bf16 moments only
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

// True when any grad[i] * inv_scale is inf/nan; a read-only parallel sweep.
bool any_nonfinite(const void* grad, Dtype dt, size_t n, float inv_scale, SimdLevel level);

// Runs one step. Returns true when a gradient was inf/nan after unscaling:
// then no buffer was written (needs check_finite). `level` picks the code path.
bool adam_step(const AdamArgs& a, SimdLevel level);

// Kernels over [lo, hi), one per code path. They update whatever the gradients
// hold: the inf/nan verdict is adam_step's read-only sweep before them.
void adam_range_scalar(const AdamArgs& a, const AdamScalars& s, size_t lo, size_t hi);
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
