// The SIMD body of CPU Adam, written once over a vector traits type `V`.
// Included by adam_avx2.cpp and adam_avx512.cpp inside a `#pragma GCC
// target` region, with V defined there. It must stay operation-for-operation
// identical to adam_range_scalar (see [Note: matching torch bit for bit]),
// and it uses no std:: templates, so no ISA-specific copy of a shared inline
// function can leak into other translation units. The including file opens
// an anonymous namespace and defines INFINITY_ISA_SUFFIX; this file closes
// the namespace and defines adam_range_<suffix> and nonfinite_<suffix>.

// moment_bits (adam.hpp) for the V::kWidth elements from i.
static typename V::I moment_bits_v(uint32_t seed, size_t i) {
  typename V::I x = V::ixor(V::imul(V::iota(static_cast<uint32_t>(i)), V::iset1(0x9e3779b1u)), V::iset1(seed));
  x = V::ixor(x, V::template isrl<16>(x));
  x = V::imul(x, V::iset1(0x7feb352du));
  x = V::ixor(x, V::template isrl<15>(x));
  x = V::imul(x, V::iset1(0x846ca68bu));
  return V::ixor(x, V::template isrl<16>(x));
}

// LOWP: 0 none, 1 bf16, 2 fp16. MOM: 0 fp32 moments, 1 bf16 nearest-even, 2 bf16 stochastic.
template <Dtype G, int LOWP, int MOM>
static bool adam_kernel(const AdamArgs& a, const AdamScalars& s, size_t lo, size_t hi) {
  typedef typename V::F F;
  float* const m32 = static_cast<float*>(a.exp_avg);
  float* const v32 = static_cast<float*>(a.exp_avg_sq);
  uint16_t* const m16 = static_cast<uint16_t*>(a.exp_avg);
  uint16_t* const v16 = static_cast<uint16_t*>(a.exp_avg_sq);
  const F inv = V::set1(s.inv_scale), decay = V::set1(s.decay), l2 = V::set1(s.l2);
  const F w1 = V::set1(s.w1), omw1 = V::set1(1.0f - s.w1), beta2 = V::set1(s.beta2), c2 = V::set1(s.c2);
  const F bc2 = V::set1(s.bc2_sqrt), inv_bc2 = V::set1(s.inv_bc2_sqrt), eps = V::set1(s.eps), neg_step = V::set1(s.neg_step);
  const bool use_l2 = s.l2 != 0.0f, lerp_low = s.lerp_low;
  typename V::Mask bad = V::no_mask();
  size_t i = lo;
  for (; i + V::kWidth <= hi; i += V::kWidth) {
    F g = V::mul(V::template load_grad<G>(a.grad, i), inv);
    bad = V::or_nonfinite(bad, g);
    F p = V::load(a.param + i);
    if (use_l2) g = V::add(g, V::mul(l2, p));
    p = V::mul(p, decay);
    F m = MOM ? V::load_bf16(m16 + i) : V::load(m32 + i);
    m = lerp_low ? V::add(m, V::mul(w1, V::sub(g, m))) : V::sub(g, V::mul(V::sub(g, m), omw1));
    F v = V::mul(MOM ? V::load_bf16(v16 + i) : V::load(v32 + i), beta2);
    v = V::add(v, V::mul(V::mul(c2, g), g));
    F denom = MOM ? V::add(V::mul(V::sqrt(v), inv_bc2), eps) : V::add(V::div(V::sqrt(v), bc2), eps);
    p = V::add(p, V::mul(neg_step, V::div(m, denom)));
    V::store(a.param + i, p);
    if (MOM == 0) {
      V::store(m32 + i, m);
      V::store(v32 + i, v);
    } else if (MOM == 1) {
      V::store_bf16(m16 + i, m);
      V::store_bf16(v16 + i, v);
    } else {
      const typename V::I bits = moment_bits_v(a.moment_seed, i);
      V::store_bf16_stochastic(m16 + i, m, V::iand(bits, V::iset1(0xffffu)));
      V::store_bf16_stochastic(v16 + i, v, V::template isrl<16>(bits));
    }
    if (LOWP == 1) V::store_bf16(static_cast<uint16_t*>(a.out_lowp) + i, p);
    if (LOWP == 2) V::store_f16(static_cast<uint16_t*>(a.out_lowp) + i, p);
  }
  bool nonfinite = V::any(bad);
  if (i < hi) nonfinite |= adam_range_scalar(a, s, i, hi);
  return nonfinite;
}

template <Dtype G>
static bool nonfinite_kernel(const void* grad, float inv_scale, size_t lo, size_t hi) {
  const typename V::F inv = V::set1(inv_scale);
  typename V::Mask bad = V::no_mask();
  size_t i = lo;
  // Four independent loads per iteration plus a software prefetch: a
  // read-only stream is limited by how many misses one core keeps in flight.
  for (; i + 4 * V::kWidth <= hi; i += 4 * V::kWidth) {
    V::template prefetch_grad<G>(grad, i + 64 * V::kWidth);
    typename V::F a = V::mul(V::template load_grad<G>(grad, i), inv);
    typename V::F b = V::mul(V::template load_grad<G>(grad, i + V::kWidth), inv);
    typename V::F c = V::mul(V::template load_grad<G>(grad, i + 2 * V::kWidth), inv);
    typename V::F d = V::mul(V::template load_grad<G>(grad, i + 3 * V::kWidth), inv);
    bad = V::or_nonfinite(V::or_nonfinite(bad, a), b);
    bad = V::or_nonfinite(V::or_nonfinite(bad, c), d);
  }
  for (; i + V::kWidth <= hi; i += V::kWidth) bad = V::or_nonfinite(bad, V::mul(V::template load_grad<G>(grad, i), inv));
  return V::any(bad) || (i < hi && nonfinite_scalar(grad, G, inv_scale, i, hi));
}

template <Dtype G, int LOWP>
static bool adam_dispatch_moments(const AdamArgs& a, const AdamScalars& s, size_t lo, size_t hi) {
  if (a.moment_dtype != Dtype::kBF16) return adam_kernel<G, LOWP, 0>(a, s, lo, hi);
  return a.moment_rounding == Rounding::kStochastic ? adam_kernel<G, LOWP, 2>(a, s, lo, hi)
                                                    : adam_kernel<G, LOWP, 1>(a, s, lo, hi);
}

template <Dtype G>
static bool adam_dispatch_lowp(const AdamArgs& a, const AdamScalars& s, size_t lo, size_t hi) {
  if (!a.out_lowp) return adam_dispatch_moments<G, 0>(a, s, lo, hi);
  return a.lowp_dtype == Dtype::kBF16 ? adam_dispatch_moments<G, 1>(a, s, lo, hi)
                                      : adam_dispatch_moments<G, 2>(a, s, lo, hi);
}

static bool adam_dispatch(const AdamArgs& a, const AdamScalars& s, size_t lo, size_t hi) {
  switch (a.grad_dtype) {
    case Dtype::kBF16: return adam_dispatch_lowp<Dtype::kBF16>(a, s, lo, hi);
    case Dtype::kF16: return adam_dispatch_lowp<Dtype::kF16>(a, s, lo, hi);
    default: return adam_dispatch_lowp<Dtype::kF32>(a, s, lo, hi);
  }
}

static bool nonfinite_dispatch(const void* grad, Dtype dt, float inv_scale, size_t lo, size_t hi) {
  switch (dt) {
    case Dtype::kBF16: return nonfinite_kernel<Dtype::kBF16>(grad, inv_scale, lo, hi);
    case Dtype::kF16: return nonfinite_kernel<Dtype::kF16>(grad, inv_scale, lo, hi);
    default: return nonfinite_kernel<Dtype::kF32>(grad, inv_scale, lo, hi);
  }
}

}  // namespace

// The exported entry points of this ISA (names from INFINITY_ISA_SUFFIX).
#define INFINITY_CAT2(a, b) a##b
#define INFINITY_CAT(a, b) INFINITY_CAT2(a, b)
bool INFINITY_CAT(adam_range_, INFINITY_ISA_SUFFIX)(const AdamArgs& a, const AdamScalars& s, size_t lo, size_t hi) {
  return adam_dispatch(a, s, lo, hi);
}
bool INFINITY_CAT(nonfinite_, INFINITY_ISA_SUFFIX)(const void* grad, Dtype dt, float inv_scale, size_t lo,
                                                    size_t hi) {
  return nonfinite_dispatch(grad, dt, inv_scale, lo, hi);
}
