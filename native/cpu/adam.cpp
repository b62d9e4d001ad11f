// Dispatch, threading and the scalar reference of CPU Adam.
//
// [Note: matching torch bit for bit]
// Every SIMD path reproduces the scalar reference exactly: the same float
// operations in the same order, no fused multiply-add (this file and the
// SIMD files build with -ffp-contract=off), and sqrt/div are IEEE-exact in
// both. The order follows torch.optim.AdamW's single-tensor implementation,
// so results agree with torch to a few ulp per step.
#include "adam.hpp"

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
  s.eps = static_cast<float>(a.eps);
  s.neg_step = static_cast<float>(-(a.lr / bc1));
  return s;
}

// The reference. One element at a time, in torch.optim.AdamW's order.
bool adam_range_scalar(const AdamArgs& a, const AdamScalars& s, size_t lo, size_t hi) {
  bool nonfinite = false;
  for (size_t i = lo; i < hi; ++i) {
    float g = load_grad(a.grad, a.grad_dtype, i) * s.inv_scale;  // unscale: grad * (1 / loss_scale)
    nonfinite |= !std::isfinite(g);                               // overflowed or inf/nan gradient
    float p = a.param[i];
    if (s.l2 != 0.0f) g = g + s.l2 * p;                           // Adam: L2 penalty joins the gradient
    p = p * s.decay;                                              // AdamW: param.mul_(1 - lr * wd)
    float m = a.exp_avg[i];
    m = s.lerp_low ? m + s.w1 * (g - m)                           // exp_avg.lerp_(grad, 1 - beta1),
                   : g - (g - m) * (1.0f - s.w1);                 //   both of torch's lerp formulas
    float v = a.exp_avg_sq[i] * s.beta2;                          // exp_avg_sq.mul_(beta2)
    v = v + s.c2 * g * g;                                         //   .addcmul_(grad, grad, 1 - beta2)
    float denom = std::sqrt(v) / s.bc2_sqrt + s.eps;              // (sqrt(v) / sqrt(bc2)).add_(eps)
    p = p + s.neg_step * (m / denom);                             // param.addcdiv_(m, denom, -lr / bc1)
    a.param[i] = p;                                               // write back the fp32 master weight,
    a.exp_avg[i] = m;                                             //   first moment,
    a.exp_avg_sq[i] = v;                                          //   second moment,
    if (a.out_lowp) {                                             //   and the low-precision copy
      uint16_t* out = static_cast<uint16_t*>(a.out_lowp);
      out[i] = a.lowp_dtype == Dtype::kBF16 ? f32_to_bf16(p) : f32_to_f16(p);
    }
  }
  return nonfinite;
}

bool nonfinite_scalar(const void* grad, Dtype dt, float inv_scale, size_t lo, size_t hi) {
  for (size_t i = lo; i < hi; ++i)
    if (!std::isfinite(load_grad(grad, dt, i) * inv_scale)) return true;
  return false;
}

bool any_nonfinite(const void* grad, Dtype dt, size_t n, float inv_scale, SimdLevel level) {
  auto scan = nonfinite_scalar;
#if defined(__x86_64__) && defined(__GNUC__)
  if (level == SimdLevel::kAvx512) scan = nonfinite_avx512;
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
  if (level == SimdLevel::kAvx2) update = adam_range_avx2;
#endif
  // "Leave every buffer untouched" needs the verdict before the first
  // write, so the check is its own read-only sweep over the gradients
  // (2-4 of the ~30 bytes an element moves); the state is touched once.
  if (a.check_finite && any_nonfinite(a.grad, a.grad_dtype, a.n, s.inv_scale, level)) return true;
  parallel_for(a.n, kAlign, kMinPerThread, [&](size_t lo, size_t hi) { update(a, s, lo, hi); });
  return false;
}

}  // namespace infinity::cpu
