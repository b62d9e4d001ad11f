// AVX-512 path of CPU Adam (16 floats per step). Compiled for any x86-64 and
// only called after CPUID says AVX-512F/BW/VL are there (simd.cpp).
#include <cstddef>
#include <cstdint>

#include "adam.hpp"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c")

#define INFINITY_AVX512_BF16 0
#define INFINITY_ISA_SUFFIX avx512
#include "adam_avx512_body.inl"

#pragma GCC pop_options
#endif  // x86-64: other architectures dispatch to scalar (adam.cpp)
