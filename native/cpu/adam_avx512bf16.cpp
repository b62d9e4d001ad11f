// AVX-512 with AVX512_BF16 (SimdLevel::kAvx512Bf16): the kAvx512 kernel, with
// bf16 moments rounded by VCVTNE2PS2BF16, 32 values per instruction (see [Note:
// bf16 moments round as VCVTNE2PS2BF16 does] in lowp.hpp). Only called after
// CPUID says the CPU has it (simd.cpp, which needs GCC 12's cpu_supports name).
#include <cstddef>
#include <cstdint>

#include "adam.hpp"

#if defined(__x86_64__) && defined(__GNUC__) && __GNUC__ >= 12
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,f16c")

#define INFINITY_AVX512_BF16 1
#define INFINITY_ISA_SUFFIX avx512bf16
#include "adam_avx512_body.inl"

#pragma GCC pop_options
#elif defined(__x86_64__) && defined(__GNUC__)
namespace infinity::cpu {
// Never selected (cpu_has_avx512_bf16() is false with this compiler); the plain AVX-512 kernel stands in.
void adam_range_avx512bf16(const AdamArgs& a, const AdamScalars& s, size_t lo, size_t hi) {
  adam_range_avx512(a, s, lo, hi);
}
}  // namespace infinity::cpu
#endif
