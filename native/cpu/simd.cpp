#include "simd.hpp"

#include <cstdlib>
#include <cstring>

namespace infinity::cpu {

bool cpu_has_avx512_bf16() {
#if defined(__x86_64__) && defined(__GNUC__) && __GNUC__ >= 12
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

SimdLevel detected_simd() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl"))
    return cpu_has_avx512_bf16() ? SimdLevel::kAvx512Bf16 : SimdLevel::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return SimdLevel::kAvx2;
#endif
  return SimdLevel::kScalar;
}

SimdLevel active_simd() {
  SimdLevel hw = detected_simd();
  const char* env = std::getenv("INFINITY_SIMD");
  if (!env || !*env) return hw;
  SimdLevel want = std::strcmp(env, "scalar") == 0 ? SimdLevel::kScalar
                 : std::strcmp(env, "avx2") == 0   ? SimdLevel::kAvx2
                 : std::strcmp(env, "avx512") == 0 ? SimdLevel::kAvx512
                                                   : SimdLevel::kAvx512Bf16;
  return static_cast<int>(want) < static_cast<int>(hw) ? want : hw;
}

const char* simd_name(SimdLevel level) {
  switch (level) {
    case SimdLevel::kAvx512Bf16: return "avx512_bf16";
    case SimdLevel::kAvx512: return "avx512";
    case SimdLevel::kAvx2: return "avx2";
    default: return "scalar";
  }
}

}  // namespace infinity::cpu
