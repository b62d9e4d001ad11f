// The AVX-512 CPU Adam's vector traits and kernel, included by adam_avx512.cpp
// and adam_avx512bf16.cpp inside their `#pragma GCC target` regions. They
// differ only in store_bf16x2_flush (INFINITY_AVX512_BF16), and each defines
// INFINITY_ISA_SUFFIX first.
//
// bf16 is produced with integer round-to-nearest-even rather than the
// AVX512_BF16 VCVTNEPS2BF16 instruction where it must match torch's
// `tensor.to(torch.bfloat16)` (the parameter copy): that instruction flushes
// subnormal inputs to zero, and torch does not. The moments round as the
// instruction does on every path (see lowp.hpp), so there it is used.

namespace infinity::cpu {
namespace {

struct V {
  typedef __m512 F;
  typedef __mmask16 Mask;
  static constexpr size_t kWidth = 16;
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F sqrt(F a) { return _mm512_sqrt_ps(a); }
  static Mask no_mask() { return 0; }
  static bool any(Mask m) { return m != 0; }
  // inf and nan are exactly the floats whose exponent bits are all ones.
  static Mask or_nonfinite(Mask m, F x) {
    const __m512i e = _mm512_set1_epi32(0x7f800000);
    return m | _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(x), e), e);
  }
  template <Dtype G>
  static void prefetch_grad(const void* g, size_t i) {
    const char* base = static_cast<const char*>(g) + i * (G == Dtype::kF32 ? 4 : 2);
    _mm_prefetch(base, _MM_HINT_T0);
  }
  template <Dtype G>
  static F load_grad(const void* g, size_t i) {
    if (G == Dtype::kF32) return _mm512_loadu_ps(static_cast<const float*>(g) + i);
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(g) + i));
    if (G == Dtype::kF16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  // 32-bit integer lanes, for the stochastic-rounding hash (moment_bits_v in adam_kernel.inl).
  typedef __m512i I;
  static I iset1(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
  static I iota(uint32_t base) { return _mm512_add_epi32(iset1(base), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)); }
  static I iadd(I a, I b) { return _mm512_add_epi32(a, b); }
  static I imul(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static I ixor(I a, I b) { return _mm512_xor_si512(a, b); }
  static I iand(I a, I b) { return _mm512_and_si512(a, b); }
  template <int k>
  static I isrl(I a) { return _mm512_srli_epi32(a, k); }
  // For 8-bit moments (adam_kernel8 in adam_kernel.inl).
  static I isub(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I ior(I a, I b) { return _mm512_or_si512(a, b); }
  template <int k>
  static I isll(I a) { return _mm512_slli_epi32(a, k); }
  static I fbits(F x) { return _mm512_castps_si512(x); }
  static F ibits(I x) { return _mm512_castsi512_ps(x); }
  static I iclamp(I x, int lo, int hi) { return _mm512_min_epi32(_mm512_max_epi32(x, _mm512_set1_epi32(lo)), _mm512_set1_epi32(hi)); }
  static I imaxu(I a, I b) { return _mm512_max_epu32(a, b); }
  static uint32_t hmaxu(I a) { return _mm512_reduce_max_epu32(a); }
  static I zero_where_zero(I x, I test) { return _mm512_maskz_mov_epi32(_mm512_test_epi32_mask(test, test), x); }
  static I load_u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static void store_u8(uint8_t* p, I x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(x)); }
  static F load_bf16(const uint16_t* p) { return load_grad<Dtype::kBF16>(p, 0); }
  // One vector of bf16 from 32-bit lanes whose high halves are the bf16 bits (the *_unshifted forms below).
  static void store_high_half(uint16_t* out, __m512i r) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
  }
  static void store_bf16(uint16_t* out, F x) { store_high_half(out, rne_unshifted(x)); }
  static void store_bf16_stochastic(uint16_t* out, F x, I rnd) { store_high_half(out, sr_unshifted(x, rnd)); }
  static void store_f16(uint16_t* out, F x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                        _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  // [Note: bf16 pairs by word permutes]
  // The unrolled loop converts 32 values at a time. One 64-byte load of 32
  // bf16 values is spread into two float vectors by one masked word permute
  // each (VPERMW: value k into the high half of lane k, zeros below), and two
  // rounded vectors are narrowed into one 64-byte store by one two-source
  // permute (VPERMT2W: the high halves of both, in order), where the
  // one-vector forms take a widen and a shift, or a shift and a narrowing
  // move, per 16. The rounding is the same integer arithmetic as store_bf16
  // (without the final shift: the permute keeps the high half), so the bits
  // are identical; NaN lanes become all ones, whose high half is 0xffff.
  static __m512i words(const uint16_t (&w)[32]) { return _mm512_loadu_si512(w); }
  static void load_bf16x2(const uint16_t* p, F& a, F& b) {
    static const uint16_t lo[32] = {0, 0, 0, 1, 0, 2, 0, 3, 0, 4, 0, 5, 0, 6, 0, 7,
                                    0, 8, 0, 9, 0, 10, 0, 11, 0, 12, 0, 13, 0, 14, 0, 15};
    static const uint16_t hi[32] = {0, 16, 0, 17, 0, 18, 0, 19, 0, 20, 0, 21, 0, 22, 0, 23,
                                    0, 24, 0, 25, 0, 26, 0, 27, 0, 28, 0, 29, 0, 30, 0, 31};
    const __m512i x = _mm512_loadu_si512(p);
    a = _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, words(lo), x));
    b = _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, words(hi), x));
  }
  static __m512i nan_to_ones(F x, __m512i r) {
    return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(-1));
  }
  static void store_high_halves(uint16_t* out, __m512i a, __m512i b) {
    static const uint16_t odd[32] = {1,  3,  5,  7,  9,  11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31,
                                     33, 35, 37, 39, 41, 43, 45, 47, 49, 51, 53, 55, 57, 59, 61, 63};
    _mm512_storeu_si512(out, _mm512_permutex2var_epi16(a, words(odd), b));
  }
  static __m512i rne_unshifted(F x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return nan_to_ones(x, _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))));
  }
  static void store_bf16x2(uint16_t* out, F a, F b) { store_high_halves(out, rne_unshifted(a), rne_unshifted(b)); }
  static __m512i sr_unshifted(F x, I rnd) { return nan_to_ones(x, _mm512_add_epi32(_mm512_castps_si512(x), rnd)); }
  static void store_bf16x2_stochastic(uint16_t* out, F a, F b, I ra, I rb) {
    store_high_halves(out, sr_unshifted(a, ra), sr_unshifted(b, rb));
  }
  // The moments' rounding ([Note: bf16 moments round as VCVTNE2PS2BF16 does] in lowp.hpp): the instruction
  // itself where the CPU has it (adam_avx512bf16.cpp), else the same arithmetic on integers.
  static __m512i flush_unshifted(F x) {
    const __m512i u = _mm512_castps_si512(x);
    __m512i r = rne_unshifted(x);  // NaN lanes are all ones here; they are set below
    const __mmask16 tiny = _mm512_testn_epi32_mask(u, _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_mov_epi32(r, tiny, _mm512_and_si512(u, _mm512_set1_epi32(static_cast<int>(0x80000000u))));
    return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q),
                                 _mm512_or_si512(u, _mm512_set1_epi32(0x00400000)));
  }
  static void store_bf16_flush(uint16_t* out, F x) { store_high_half(out, flush_unshifted(x)); }
  static void store_bf16x2_flush(uint16_t* out, F a, F b) {
#if INFINITY_AVX512_BF16
    _mm512_storeu_si512(out, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a)));
#else
    store_high_halves(out, flush_unshifted(a), flush_unshifted(b));
#endif
  }
};

#include "adam_kernel.inl"

}  // namespace infinity::cpu
