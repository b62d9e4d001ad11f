// AVX-512 path of CPU Adam (16 floats per step). Compiled for any x86-64 and
// only called after CPUID says AVX-512F/BW/VL are there (simd.cpp).
//
// bf16 is produced with integer round-to-nearest-even rather than the
// AVX512_BF16 VCVTNEPS2BF16 instruction: that instruction flushes subnormal
// inputs to zero, and torch's `tensor.to(torch.bfloat16)` does not. The
// integer form is 6 ops per 16 values in a memory-bound loop, so it costs
// nothing measurable.
#include <cstddef>
#include <cstdint>

#include "adam.hpp"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c")

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
  static F load_bf16(const uint16_t* p) { return load_grad<Dtype::kBF16>(p, 0); }
  // Stores the bf16 bits r (one per 32-bit lane, <= 0xffff), with 0xffff for the lanes where x is NaN.
  static void store_bf16_bits(uint16_t* out, F x, __m512i r) {
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0xffff));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(r));
  }
  static void store_bf16(uint16_t* out, F x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    store_bf16_bits(out, x, _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16));
  }
  static void store_bf16_stochastic(uint16_t* out, F x, I rnd) {
    store_bf16_bits(out, x, _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(x), rnd), 16));
  }
  static void store_f16(uint16_t* out, F x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                        _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
};

#define INFINITY_ISA_SUFFIX avx512
#include "adam_kernel.inl"

}  // namespace infinity::cpu

#pragma GCC pop_options
#endif  // x86-64: other architectures dispatch to scalar (adam.cpp)
