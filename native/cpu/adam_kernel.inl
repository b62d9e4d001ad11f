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
static void adam_kernel(const AdamArgs& a, const AdamScalars& s, size_t lo, size_t hi) {
  typedef typename V::F F;
  float* const m32 = static_cast<float*>(a.exp_avg);
  float* const v32 = static_cast<float*>(a.exp_avg_sq);
  uint16_t* const m16 = static_cast<uint16_t*>(a.exp_avg);
  uint16_t* const v16 = static_cast<uint16_t*>(a.exp_avg_sq);
  const F inv = V::set1(s.inv_scale), decay = V::set1(s.decay), l2 = V::set1(s.l2);
  const F w1 = V::set1(s.w1), omw1 = V::set1(1.0f - s.w1), beta2 = V::set1(s.beta2), c2 = V::set1(s.c2);
  const F bc2 = V::set1(s.bc2_sqrt), inv_bc2 = V::set1(s.inv_bc2_sqrt), eps = V::set1(s.eps), neg_step = V::set1(s.neg_step);
  const bool use_l2 = s.l2 != 0.0f, lerp_low = s.lerp_low;
  // One vector's update (the arithmetic of every lane, unchanged from adam_range_scalar). The main loop
  // runs two vectors per turn so that bf16 moments and copies convert 2 x V::kWidth values at once.
  struct Lane {
    F g, p, m, v;
  };
  auto load = [&](size_t j) {
    Lane l;
    l.g = V::mul(V::template load_grad<G>(a.grad, j), inv);
    l.p = V::load(a.param + j);
    l.m = MOM ? V::load_bf16(m16 + j) : V::load(m32 + j);
    l.v = MOM ? V::load_bf16(v16 + j) : V::load(v32 + j);
    return l;
  };
  auto update = [&](Lane& l) {
    if (use_l2) l.g = V::add(l.g, V::mul(l2, l.p));
    l.p = V::mul(l.p, decay);
    l.m = lerp_low ? V::add(l.m, V::mul(w1, V::sub(l.g, l.m))) : V::sub(l.g, V::mul(V::sub(l.g, l.m), omw1));
    l.v = V::add(V::mul(l.v, beta2), V::mul(V::mul(c2, l.g), l.g));
    F denom = MOM ? V::add(V::mul(V::sqrt(l.v), inv_bc2), eps) : V::add(V::div(V::sqrt(l.v), bc2), eps);
    l.p = V::add(l.p, V::mul(neg_step, V::div(l.m, denom)));
  };
  auto store = [&](const Lane& l, size_t j) {
    V::store(a.param + j, l.p);
    if (MOM == 0) {
      V::store(m32 + j, l.m);
      V::store(v32 + j, l.v);
    } else if (MOM == 1) {
      V::store_bf16_flush(m16 + j, l.m);
      V::store_bf16_flush(v16 + j, l.v);
    } else {
      const typename V::I bits = moment_bits_v(a.moment_seed, j);
      V::store_bf16_stochastic(m16 + j, l.m, V::iand(bits, V::iset1(0xffffu)));
      V::store_bf16_stochastic(v16 + j, l.v, V::template isrl<16>(bits));
    }
    if (LOWP == 1) V::store_bf16(static_cast<uint16_t*>(a.out_lowp) + j, l.p);
    if (LOWP == 2) V::store_f16(static_cast<uint16_t*>(a.out_lowp) + j, l.p);
  };
  size_t i = lo;
  const size_t w = V::kWidth;
  for (; i + 2 * w <= hi; i += 2 * w) {
    Lane x, y;
    x.g = V::mul(V::template load_grad<G>(a.grad, i), inv);
    y.g = V::mul(V::template load_grad<G>(a.grad, i + w), inv);
    x.p = V::load(a.param + i);
    y.p = V::load(a.param + i + w);
    if (MOM) {  // bf16 moments: 2 x V::kWidth values per conversion (see [Note: bf16 pairs by word permutes])
      V::load_bf16x2(m16 + i, x.m, y.m);
      V::load_bf16x2(v16 + i, x.v, y.v);
    } else {
      x.m = V::load(m32 + i), y.m = V::load(m32 + i + w);
      x.v = V::load(v32 + i), y.v = V::load(v32 + i + w);
    }
    update(x);
    update(y);
    V::store(a.param + i, x.p);
    V::store(a.param + i + w, y.p);
    if (MOM == 0) {
      V::store(m32 + i, x.m), V::store(m32 + i + w, y.m);
      V::store(v32 + i, x.v), V::store(v32 + i + w, y.v);
    } else if (MOM == 1) {
      V::store_bf16x2_flush(m16 + i, x.m, y.m);
      V::store_bf16x2_flush(v16 + i, x.v, y.v);
    } else {
      const typename V::I bx = moment_bits_v(a.moment_seed, i), by = moment_bits_v(a.moment_seed, i + w);
      const typename V::I low = V::iset1(0xffffu);
      V::store_bf16x2_stochastic(m16 + i, x.m, y.m, V::iand(bx, low), V::iand(by, low));
      V::store_bf16x2_stochastic(v16 + i, x.v, y.v, V::template isrl<16>(bx), V::template isrl<16>(by));
    }
    if (LOWP == 1) V::store_bf16x2(static_cast<uint16_t*>(a.out_lowp) + i, x.p, y.p);
    if (LOWP == 2) {
      V::store_f16(static_cast<uint16_t*>(a.out_lowp) + i, x.p);
      V::store_f16(static_cast<uint16_t*>(a.out_lowp) + i + w, y.p);
    }
  }
  for (; i + V::kWidth <= hi; i += V::kWidth) {
    Lane x = load(i);
    update(x);
    store(x, i);
  }
  if (i < hi) adam_range_scalar(a, s, i, hi);
}

// 8-bit moments: decode8 / encode8 (adam.hpp) for V::kWidth lanes.
template <int M>
static typename V::F decode8_v(typename V::I code, uint32_t e) {
  const typename V::I mag = V::iand(code, V::iset1((1u << (4 + M)) - 1));
  typename V::I bits = V::template isll<23 - M>(V::iadd(mag, V::iset1((e - 15) << M)));
  bits = V::zero_where_zero(bits, mag);
  if (M == 3) bits = V::ior(bits, V::template isll<31>(V::template isrl<7>(code)));
  return V::ibits(bits);
}

template <int M>
static typename V::I encode8_v(typename V::F x, uint32_t e, typename V::I r, bool nearest) {
  constexpr int cut = 23 - M;
  const typename V::I bits = V::fbits(x), a = V::iand(bits, V::iset1(0x7fffffffu));
  if (nearest) r = V::iadd(V::iset1((1u << (cut - 1)) - 1), V::iand(V::template isrl<cut>(a), V::iset1(1)));
  typename V::I q = V::isub(V::template isrl<cut>(V::iadd(a, r)), V::iset1((e - 15) << M));
  q = V::iclamp(q, 0, (1 << (4 + M)) - 1);
  if (M == 3) q = V::ior(q, V::template isll<7>(V::template isrl<31>(bits)));
  return q;
}

// Adam over 8-bit moments, a block at a time: adam_block8_scalar's two passes (decode and update, keeping the
// new m and u = sqrt(v) in L1; then the scales and the codes), operation for operation. A last, partial
// block goes to the scalar reference.
static_assert(kMomentBlock % (2 * V::kWidth) == 0, "a block is whole pairs of vectors");

template <Dtype G, int LOWP>
static void adam_kernel8(const AdamArgs& a, const AdamScalars& s, size_t lo, size_t hi) {
  typedef typename V::F F;
  typedef typename V::I I;
  // Locals, not a.*: the stores below could alias AdamArgs as far as the compiler knows.
  float* const param = a.param;
  const void* const grad = a.grad;
  uint16_t* const out = static_cast<uint16_t*>(a.out_lowp);
  const uint8_t* const mc = static_cast<const uint8_t*>(a.exp_avg);
  const uint8_t* const vc = static_cast<const uint8_t*>(a.exp_avg_sq);
  uint8_t* const mo = static_cast<uint8_t*>(a.exp_avg);
  uint8_t* const vo = static_cast<uint8_t*>(a.exp_avg_sq);
  const F inv = V::set1(s.inv_scale), decay = V::set1(s.decay), l2 = V::set1(s.l2);
  const F w1 = V::set1(s.w1), omw1 = V::set1(1.0f - s.w1), beta2 = V::set1(s.beta2), c2 = V::set1(s.c2);
  const F inv_bc2 = V::set1(s.inv_bc2_sqrt), eps = V::set1(s.eps), neg_step = V::set1(s.neg_step);
  const I abs_mask = V::iset1(0x7fffffffu), low16 = V::iset1(0xffffu);
  const bool use_l2 = s.l2 != 0.0f, lerp_low = s.lerp_low;
  const bool nearest = a.moment_rounding != Rounding::kStochastic;
  alignas(64) float new_m[kMomentBlock];
  alignas(64) float new_u[kMomentBlock];
  for (size_t b0 = lo; b0 < hi; b0 += kMomentBlock) {
    if (hi - b0 < kMomentBlock) {
      adam_block8_scalar(a, s, b0, hi);
      break;
    }
    const size_t blk = b0 / kMomentBlock;
    uint32_t em, ev;
    memcpy(&em, a.exp_avg_scale + blk, 4);
    memcpy(&ev, a.exp_avg_sq_scale + blk, 4);
    em >>= 23, ev >>= 23;
    I peak_m = V::iset1(0), peak_u = V::iset1(0);
    // Pass 1, two vectors per turn: their divisions and square roots overlap.
    auto lane = [&](size_t j) {
      const size_t i = b0 + j;
      F g = V::mul(V::template load_grad<G>(grad, i), inv);
      F p = V::load(param + i);
      if (use_l2) g = V::add(g, V::mul(l2, p));
      p = V::mul(p, decay);
      F m = decode8_v<3>(V::load_u8(mc + i), em);
      m = lerp_low ? V::add(m, V::mul(w1, V::sub(g, m))) : V::sub(g, V::mul(V::sub(g, m), omw1));
      const F u_old = decode8_v<4>(V::load_u8(vc + i), ev);
      F v = V::mul(V::mul(u_old, u_old), beta2);
      v = V::add(v, V::mul(V::mul(c2, g), g));
      const F u = V::sqrt(v);
      p = V::add(p, V::mul(neg_step, V::div(m, V::add(V::mul(u, inv_bc2), eps))));
      V::store(param + i, p);
      if (LOWP == 1) V::store_bf16(out + i, p);
      if (LOWP == 2) V::store_f16(out + i, p);
      V::store(new_m + j, m);
      V::store(new_u + j, u);
      peak_m = V::imaxu(peak_m, V::iand(V::fbits(m), abs_mask));
      peak_u = V::imaxu(peak_u, V::iand(V::fbits(u), abs_mask));
    };
    for (size_t j = 0; j < kMomentBlock; j += 2 * V::kWidth) {
      lane(j);
      lane(j + V::kWidth);
    }
    const uint32_t nm = block_exponent(V::hmaxu(peak_m), kExpFloorM), nv = block_exponent(V::hmaxu(peak_u), kExpFloorV);
    const uint32_t sm = nm << 23, sv = nv << 23;
    memcpy(a.exp_avg_scale + blk, &sm, 4);
    memcpy(a.exp_avg_sq_scale + blk, &sv, 4);
    for (size_t j = 0; j < kMomentBlock; j += V::kWidth) {
      const size_t i = b0 + j;
      I rm = V::iset1(0), rv = V::iset1(0);
      if (!nearest) {
        const I bits = moment_bits_v(a.moment_seed, i);
        rm = V::template isll<4>(V::iand(bits, low16));
        rv = V::template isll<3>(V::template isrl<16>(bits));
      }
      V::store_u8(mo + i, encode8_v<3>(V::load(new_m + j), nm, rm, nearest));
      V::store_u8(vo + i, encode8_v<4>(V::load(new_u + j), nv, rv, nearest));
    }
  }
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
static void adam_dispatch_moments(const AdamArgs& a, const AdamScalars& s, size_t lo, size_t hi) {
  if (a.moment_dtype == Dtype::kI8) return adam_kernel8<G, LOWP>(a, s, lo, hi);
  if (a.moment_dtype != Dtype::kBF16) return adam_kernel<G, LOWP, 0>(a, s, lo, hi);
  return a.moment_rounding == Rounding::kStochastic ? adam_kernel<G, LOWP, 2>(a, s, lo, hi)
                                                    : adam_kernel<G, LOWP, 1>(a, s, lo, hi);
}

template <Dtype G>
static void adam_dispatch_lowp(const AdamArgs& a, const AdamScalars& s, size_t lo, size_t hi) {
  if (!a.out_lowp) return adam_dispatch_moments<G, 0>(a, s, lo, hi);
  return a.lowp_dtype == Dtype::kBF16 ? adam_dispatch_moments<G, 1>(a, s, lo, hi)
                                      : adam_dispatch_moments<G, 2>(a, s, lo, hi);
}

static void adam_dispatch(const AdamArgs& a, const AdamScalars& s, size_t lo, size_t hi) {
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
void INFINITY_CAT(adam_range_, INFINITY_ISA_SUFFIX)(const AdamArgs& a, const AdamScalars& s, size_t lo, size_t hi) {
  adam_dispatch(a, s, lo, hi);
}
bool INFINITY_CAT(nonfinite_, INFINITY_ISA_SUFFIX)(const void* grad, Dtype dt, float inv_scale, size_t lo,
                                                    size_t hi) {
  return nonfinite_dispatch(grad, dt, inv_scale, lo, hi);
}
