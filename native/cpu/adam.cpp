// Dispatch, threading and the scalar reference of CPU Adam.
//
// [Note: matching torch bit for bit]
// Every SIMD path reproduces the scalar reference exactly: the same float
// operations in the same order, no fused multiply-add (this file and the
// SIMD files build with -ffp-contract=off), and sqrt/div are IEEE-exact in
// both. The order follows torch.optim.AdamW's single-tensor implementation,
// so results agree with torch to a few ulp per step.
//
// [Note: bf16 moments]
// With moment_dtype kBF16 (offload_optimizer.moments_dtype "bf16") the
// moments are loaded from bf16, the update runs in fp32 exactly as above,
// and the new moments are stored to bf16: 8 bytes of state per parameter
// instead of 12, and 20 bytes of traffic per Adam element instead of 28.
// Round-to-nearest-even stalls the second moment: one bf16 ulp is 2^-8 of
// the value, more than the 0.1% that beta2 = 0.999 takes off per step, so a
// v with small new gradients never decays. Stochastic rounding keeps every
// decay right in expectation; its bits come from moment_bits(seed, i), a
// hash of the element's index, so every code path and thread split rounds
// each element the same way. The master weights stay fp32. No torch
// implementation stores bf16 moments, so there are no torch bits to match:
// this path multiplies by 1/sqrt(bc2) where the fp32 path divides, which
// takes one of its two divisions out of a loop that division bounds.
#include "adam.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>

#include "lowp.hpp"
#include "parallel.hpp"

namespace infinity::cpu {

namespace {
constexpr size_t kAlign = 64;              // per-thread ranges start on a cache line of floats
constexpr size_t kMinPerThread = 1 << 15;  // below this, threads cost more than they save
constexpr size_t kTile = 1 << 14;          // 64 KiB of fp32 per array: the check stops early between tiles

float load_grad(const void* g, Dtype dt, size_t i) {
  switch (dt) {
    case Dtype::kBF16: return bf16_to_f32(static_cast<const uint16_t*>(g)[i]);
    case Dtype::kF16: return f16_to_f32(static_cast<const uint16_t*>(g)[i]);
    default: return static_cast<const float*>(g)[i];
  }
}

float load_moment(const void* m, Dtype dt, size_t i) {
  return dt == Dtype::kBF16 ? bf16_to_f32(static_cast<const uint16_t*>(m)[i]) : static_cast<const float*>(m)[i];
}

void store_moment(const AdamArgs& a, void* m, size_t i, float x, uint32_t r) {
  if (a.moment_dtype != Dtype::kBF16) {
    static_cast<float*>(m)[i] = x;
    return;
  }
  static_cast<uint16_t*>(m)[i] =
      a.moment_rounding == Rounding::kStochastic ? f32_to_bf16_stochastic(f32_bits(x), r) : f32_to_bf16_flush(x);
}
}  // namespace

AdamScalars adam_scalars(const AdamArgs& a) {
  AdamScalars s;
  s.inv_scale = static_cast<float>(1.0 / a.grad_scale);
  s.decay = a.adamw ? static_cast<float>(1.0 - a.lr * a.weight_decay) : 1.0f;
  s.l2 = a.adamw ? 0.0f : static_cast<float>(a.weight_decay);
  s.w1 = static_cast<float>(1.0 - a.beta1);
  s.lerp_low = s.w1 < 0.5f;
  s.beta2 = static_cast<float>(a.beta2);
  s.c2 = static_cast<float>(1.0 - a.beta2);
  double bc1 = a.bias_correction ? 1.0 - std::pow(a.beta1, static_cast<double>(a.step)) : 1.0;
  double bc2 = a.bias_correction ? 1.0 - std::pow(a.beta2, static_cast<double>(a.step)) : 1.0;
  s.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  s.inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));
  s.eps = static_cast<float>(a.eps);
  s.neg_step = static_cast<float>(-(a.lr / bc1));
  return s;
}

// The 8-bit reference, one block [lo, hi) (hi - lo <= kMomentBlock, lo a multiple of it): each element is
// decoded, updated exactly as with bf16 moments, and its new m and u = sqrt(v) are kept; then the block's
// scales come from the largest magnitudes, and the new values are encoded against them.
void adam_block8_scalar(const AdamArgs& a, const AdamScalars& s, size_t lo, size_t hi) {
  const uint8_t* mc = static_cast<const uint8_t*>(a.exp_avg);
  const uint8_t* vc = static_cast<const uint8_t*>(a.exp_avg_sq);
  const size_t b = lo / kMomentBlock;
  const uint32_t em = f32_bits(a.exp_avg_scale[b]) >> 23, ev = f32_bits(a.exp_avg_sq_scale[b]) >> 23;
  float new_m[kMomentBlock], new_u[kMomentBlock];
  uint32_t peak_m = 0, peak_u = 0;
  for (size_t i = lo; i < hi; ++i) {
    float g = load_grad(a.grad, a.grad_dtype, i) * s.inv_scale;
    float p = a.param[i];
    if (s.l2 != 0.0f) g = g + s.l2 * p;
    p = p * s.decay;
    float m = decode8<3>(mc[i], em);
    m = s.lerp_low ? m + s.w1 * (g - m) : g - (g - m) * (1.0f - s.w1);
    const float u_old = decode8<4>(vc[i], ev);
    float v = (u_old * u_old) * s.beta2;                          // v = u * u, exact (5 bits, a normal float)
    v = v + s.c2 * g * g;
    const float u = std::sqrt(v);
    p = p + s.neg_step * (m / (u * s.inv_bc2_sqrt + s.eps));
    a.param[i] = p;
    if (a.out_lowp) {
      uint16_t* out = static_cast<uint16_t*>(a.out_lowp);
      out[i] = a.lowp_dtype == Dtype::kBF16 ? f32_to_bf16(p) : f32_to_f16(p);
    }
    new_m[i - lo] = m, new_u[i - lo] = u;
    peak_m = std::max(peak_m, f32_bits(m) & 0x7fffffffu);
    peak_u = std::max(peak_u, f32_bits(u) & 0x7fffffffu);
  }
  const uint32_t nm = block_exponent(peak_m, kExpFloorM), nv = block_exponent(peak_u, kExpFloorV);
  a.exp_avg_scale[b] = bits_f32(nm << 23);
  a.exp_avg_sq_scale[b] = bits_f32(nv << 23);
  const bool nearest = a.moment_rounding != Rounding::kStochastic;
  uint8_t* mo = static_cast<uint8_t*>(a.exp_avg);
  uint8_t* vo = static_cast<uint8_t*>(a.exp_avg_sq);
  for (size_t i = lo; i < hi; ++i) {
    const uint32_t bits = nearest ? 0 : moment_bits(a.moment_seed, static_cast<uint32_t>(i));
    mo[i] = static_cast<uint8_t>(encode8<3>(new_m[i - lo], nm, (bits & 0xffffu) << 4, nearest));
    vo[i] = static_cast<uint8_t>(encode8<4>(new_u[i - lo], nv, (bits >> 16) << 3, nearest));
  }
}

// The reference. One element at a time, in torch.optim.AdamW's order.
void adam_range_scalar(const AdamArgs& a, const AdamScalars& s, size_t lo, size_t hi) {
  if (a.moment_dtype == Dtype::kI8) {
    for (size_t b = lo; b < hi; b += kMomentBlock) adam_block8_scalar(a, s, b, std::min(hi, b + kMomentBlock));
    return;
  }
  for (size_t i = lo; i < hi; ++i) {
    float g = load_grad(a.grad, a.grad_dtype, i) * s.inv_scale;  // unscale: grad * (1 / loss_scale)
    float p = a.param[i];
    if (s.l2 != 0.0f) g = g + s.l2 * p;                           // Adam: L2 penalty joins the gradient
    p = p * s.decay;                                              // AdamW: param.mul_(1 - lr * wd)
    float m = load_moment(a.exp_avg, a.moment_dtype, i);
    m = s.lerp_low ? m + s.w1 * (g - m)                           // exp_avg.lerp_(grad, 1 - beta1),
                   : g - (g - m) * (1.0f - s.w1);                 //   both of torch's lerp formulas
    float v = load_moment(a.exp_avg_sq, a.moment_dtype, i) * s.beta2;  // exp_avg_sq.mul_(beta2)
    v = v + s.c2 * g * g;                                         //   .addcmul_(grad, grad, 1 - beta2)
    float denom = a.moment_dtype == Dtype::kBF16                  // (sqrt(v) / sqrt(bc2)).add_(eps);
                      ? std::sqrt(v) * s.inv_bc2_sqrt + s.eps     //   bf16 moments: one division
                      : std::sqrt(v) / s.bc2_sqrt + s.eps;        //   less (no torch bits to match)
    p = p + s.neg_step * (m / denom);                             // param.addcdiv_(m, denom, -lr / bc1)
    a.param[i] = p;                                               // write back the fp32 master weight,
    uint32_t bits = a.moment_rounding == Rounding::kStochastic
                        ? moment_bits(a.moment_seed, static_cast<uint32_t>(i)) : 0;
    store_moment(a, a.exp_avg, i, m, bits & 0xffffu);             //   first moment,
    store_moment(a, a.exp_avg_sq, i, v, bits >> 16);              //   second moment,
    if (a.out_lowp) {                                             //   and the low-precision copy
      uint16_t* out = static_cast<uint16_t*>(a.out_lowp);
      out[i] = a.lowp_dtype == Dtype::kBF16 ? f32_to_bf16(p) : f32_to_f16(p);
    }
  }
}

bool nonfinite_scalar(const void* grad, Dtype dt, float inv_scale, size_t lo, size_t hi) {
  for (size_t i = lo; i < hi; ++i)
    if (!std::isfinite(load_grad(grad, dt, i) * inv_scale)) return true;
  return false;
}

bool any_nonfinite(const void* grad, Dtype dt, size_t n, float inv_scale, SimdLevel level) {
  auto scan = nonfinite_scalar;
#if defined(__x86_64__) && defined(__GNUC__)
  if (level >= SimdLevel::kAvx512) scan = nonfinite_avx512;
  if (level == SimdLevel::kAvx2) scan = nonfinite_avx2;
#else
  (void)level;
#endif
  std::atomic<bool> found{false};
  parallel_for(n, kAlign, kMinPerThread, [&](size_t lo, size_t hi) {
    for (size_t t = lo; t < hi && !found.load(std::memory_order_relaxed); t += kTile)
      if (scan(grad, dt, inv_scale, t, std::min(hi, t + kTile))) found.store(true);
  });
  return found.load();
}

bool adam_step(const AdamArgs& a, SimdLevel level) {
  if (a.n == 0) return false;
  const AdamScalars s = adam_scalars(a);
  auto update = adam_range_scalar;
#if defined(__x86_64__) && defined(__GNUC__)
  if (level == SimdLevel::kAvx512) update = adam_range_avx512;
  if (level == SimdLevel::kAvx512Bf16) update = adam_range_avx512bf16;
  if (level == SimdLevel::kAvx2) update = adam_range_avx2;
#endif
  // "Leave every buffer untouched" needs the verdict before the first
  // write, so the check is its own read-only sweep over the gradients
  // (2-4 of the ~30 bytes an element moves); the state is touched once.
  if (a.check_finite && any_nonfinite(a.grad, a.grad_dtype, a.n, s.inv_scale, level)) return true;
  // 8-bit moments: a thread's range is whole blocks, since a block's scale depends on all its elements.
  const size_t align = a.moment_dtype == Dtype::kI8 ? kMomentBlock : kAlign;
  parallel_for(a.n, align, kMinPerThread, [&](size_t lo, size_t hi) { update(a, s, lo, hi); });
  return false;
}

}  // namespace infinity::cpu
