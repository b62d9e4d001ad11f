// AVX2 + FMA + F16C path of CPU Adam (8 floats per step); see adam_avx512.cpp.
// FMA is in the target list only because CPUs with AVX2 have it; the kernel
// never fuses (see [Note: matching torch bit for bit] in adam.cpp).
#include <cstddef>
#include <cstdint>

#include "adam.hpp"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace infinity::cpu {
namespace {

struct V {
  typedef __m256 F;
  typedef int Mask;
  static constexpr size_t kWidth = 8;
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F sqrt(F a) { return _mm256_sqrt_ps(a); }
  static Mask no_mask() { return 0; }
  static bool any(Mask m) { return m != 0; }
  static Mask or_nonfinite(Mask m, F x) {
    const __m256i e = _mm256_set1_epi32(0x7f800000);
    __m256i hit = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(x), e), e);
    return m | _mm256_movemask_epi8(hit);
  }
  template <Dtype G>
  static void prefetch_grad(const void* g, size_t i) {
    const char* base = static_cast<const char*>(g) + i * (G == Dtype::kF32 ? 4 : 2);
    _mm_prefetch(base, _MM_HINT_T0);
  }
  template <Dtype G>
  static F load_grad(const void* g, size_t i) {
    if (G == Dtype::kF32) return _mm256_loadu_ps(static_cast<const float*>(g) + i);
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(g) + i));
    if (G == Dtype::kF16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  // 32-bit integer lanes, for the stochastic-rounding hash (moment_bits_v in adam_kernel.inl).
  typedef __m256i I;
  static I iset1(uint32_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }
  static I iota(uint32_t base) { return _mm256_add_epi32(iset1(base), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)); }
  static I iadd(I a, I b) { return _mm256_add_epi32(a, b); }
  static I imul(I a, I b) { return _mm256_mullo_epi32(a, b); }
  static I ixor(I a, I b) { return _mm256_xor_si256(a, b); }
  static I iand(I a, I b) { return _mm256_and_si256(a, b); }
  template <int k>
  static I isrl(I a) { return _mm256_srli_epi32(a, k); }
  // For 8-bit moments (adam_kernel8 in adam_kernel.inl).
  static I isub(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I ior(I a, I b) { return _mm256_or_si256(a, b); }
  template <int k>
  static I isll(I a) { return _mm256_slli_epi32(a, k); }
  static I fbits(F x) { return _mm256_castps_si256(x); }
  static F ibits(I x) { return _mm256_castsi256_ps(x); }
  static I iclamp(I x, int lo, int hi) { return _mm256_min_epi32(_mm256_max_epi32(x, _mm256_set1_epi32(lo)), _mm256_set1_epi32(hi)); }
  static I imaxu(I a, I b) { return _mm256_max_epu32(a, b); }
  static uint32_t hmaxu(I a) {
    __m128i m = _mm_max_epu32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0x4e));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0xb1));
    return static_cast<uint32_t>(_mm_cvtsi128_si32(m));
  }
  static I zero_where_zero(I x, I test) { return _mm256_andnot_si256(_mm256_cmpeq_epi32(test, _mm256_setzero_si256()), x); }
  static I load_u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
  static void store_u8(uint8_t* p, I x) {  // each lane <= 255: two unsigned-saturating packs keep it
    const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi16(w, w));
  }
  static F load_bf16(const uint16_t* p) { return load_grad<Dtype::kBF16>(p, 0); }
  // Stores the bf16 bits r (one per 32-bit lane, <= 0xffff), with 0xffff for the lanes where x is NaN.
  static void store_bf16_bits(uint16_t* out, F x, __m256i r) {
    __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0xffff), _mm256_castps_si256(nan));
    __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), packed);
  }
  // Nearest even, shifted down: the bf16 bits of a non-NaN u.
  static __m256i rne_bits(__m256i u) {
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  }
  static void store_bf16(uint16_t* out, F x) { store_bf16_bits(out, x, rne_bits(_mm256_castps_si256(x))); }
  // The moments' rounding ([Note: bf16 moments round as VCVTNE2PS2BF16 does] in lowp.hpp).
  static void store_bf16_flush(uint16_t* out, F x) {
    const __m256i u = _mm256_castps_si256(x), hi = _mm256_srli_epi32(u, 16);
    __m256i r = rne_bits(u);
    const __m256i tiny = _mm256_cmpeq_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7f800000)), _mm256_setzero_si256());
    r = _mm256_blendv_epi8(r, _mm256_and_si256(hi, _mm256_set1_epi32(0x8000)), tiny);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out),
                     _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
  }
  static void store_bf16_stochastic(uint16_t* out, F x, I rnd) {
    store_bf16_bits(out, x, _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(x), rnd), 16));
  }
  static void store_f16(uint16_t* out, F x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
  // Two vectors' worth at once (the kernel's unrolled loop): 16 values per load, pack and store. The
  // 128-bit lanes of unpack and pack interleave quarters, so one VPERMQ (in_order) puts them in order.
  static __m256i in_order(__m256i x) { return _mm256_permute4x64_epi64(x, 0xd8); }  // quarters 0, 2, 1, 3
  static void load_bf16x2(const uint16_t* p, F& a, F& b) {
    const __m256i x = in_order(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    a = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), x));  // bf16 bits to the high halves
    b = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), x));
  }
  // 0xffff in each 16-bit word of the values of a, then b, that are NaN (packed as pack_words packs).
  static __m256i nan_words(F a, F b) {
    return _mm256_packs_epi32(_mm256_castps_si256(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)),
                              _mm256_castps_si256(_mm256_cmp_ps(b, b, _CMP_UNORD_Q)));
  }
  static __m256i pack_words(__m256i a, __m256i b) { return _mm256_packus_epi32(a, b); }  // each lane <= 0xffff
  static void store_words(uint16_t* out, __m256i w) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), in_order(w));
  }
  static void store_bf16x2(uint16_t* out, F a, F b) {
    const __m256i r = pack_words(rne_bits(_mm256_castps_si256(a)), rne_bits(_mm256_castps_si256(b)));
    store_words(out, _mm256_or_si256(r, nan_words(a, b)));  // NaN: 0xffff, as store_bf16
  }
  static void store_bf16x2_stochastic(uint16_t* out, F a, F b, I ra, I rb) {
    const __m256i r = pack_words(_mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(a), ra), 16),
                                 _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(b), rb), 16));
    store_words(out, _mm256_or_si256(r, nan_words(a, b)));
  }
  // store_bf16_flush for 16 values: the rounding in 32-bit lanes, the flush and the NaN fix-up on the
  // packed 16-bit words (the high halves hold sign, exponent and the NaN's top bits).
  static void store_bf16x2_flush(uint16_t* out, F a, F b) {
    const __m256i ua = _mm256_castps_si256(a), ub = _mm256_castps_si256(b);
    __m256i r = pack_words(rne_bits(ua), rne_bits(ub));
    const __m256i hi = pack_words(_mm256_srli_epi32(ua, 16), _mm256_srli_epi32(ub, 16));
    const __m256i tiny = _mm256_cmpeq_epi16(_mm256_and_si256(hi, _mm256_set1_epi16(0x7f80)), _mm256_setzero_si256());
    r = _mm256_blendv_epi8(r, _mm256_and_si256(hi, _mm256_set1_epi16(static_cast<short>(0x8000))), tiny);
    r = _mm256_blendv_epi8(r, _mm256_or_si256(hi, _mm256_set1_epi16(0x40)), nan_words(a, b));
    store_words(out, r);
  }
};

#define INFINITY_ISA_SUFFIX avx2
#include "adam_kernel.inl"

}  // namespace infinity::cpu

#pragma GCC pop_options
#endif  // x86-64: other architectures dispatch to scalar (adam.cpp)
