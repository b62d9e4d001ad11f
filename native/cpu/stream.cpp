// The memory roofline for CPU Adam: the same bytes per element as the Adam
// kernel (read p, g, m, v; write p, m, v; optionally write a 2-byte copy)
// with arithmetic too trivial to matter. A plain copy would understate what
// the memory system gives Adam's 4-read/3-write mix.
#include <chrono>
#include <cstdint>
#include <cstring>

#include "adam.hpp"
#include "parallel.hpp"

namespace infinity::cpu {
namespace {

// The loop body, written once; each caller below compiles it for its ISA.
#define INFINITY_TRAFFIC_BODY                                 \
  if (lowp) {                                                 \
    for (size_t i = lo; i < hi; ++i) {                        \
      float x = p[i] + g[i];                                  \
      p[i] = x;                                               \
      m[i] += g[i];                                           \
      v[i] += g[i];                                           \
      uint32_t u;                                             \
      std::memcpy(&u, &x, 4);                                 \
      lowp[i] = static_cast<uint16_t>(u >> 16);               \
    }                                                         \
  } else {                                                    \
    for (size_t i = lo; i < hi; ++i) {                        \
      p[i] += g[i];                                           \
      m[i] += g[i];                                           \
      v[i] += g[i];                                           \
    }                                                         \
  }

// Dispatched by hand rather than with target_clones: an ifunc resolver runs
// before sanitizer runtimes start, which crashes TSan builds.
void traffic_default(float* __restrict p, const float* __restrict g, float* __restrict m, float* __restrict v,
                     uint16_t* __restrict lowp, size_t lo, size_t hi) {
  INFINITY_TRAFFIC_BODY
}

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx512f,avx512bw"))) void traffic_avx512(float* __restrict p, const float* __restrict g,
                                                                 float* __restrict m, float* __restrict v,
                                                                 uint16_t* __restrict lowp, size_t lo, size_t hi) {
  INFINITY_TRAFFIC_BODY
}
#endif

void traffic(float* p, const float* g, float* m, float* v, uint16_t* lowp, size_t lo, size_t hi) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (detected_simd() >= SimdLevel::kAvx512) return traffic_avx512(p, g, m, v, lowp, lo, hi);
#endif
  traffic_default(p, g, m, v, lowp, lo, hi);
}

}  // namespace

double stream_adam_traffic(float* p, const float* g, float* m, float* v, uint16_t* lowp, size_t n, int repeats) {
  auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < repeats; ++r)
    parallel_for(n, 64, 1 << 15, [&](size_t lo, size_t hi) { traffic(p, g, m, v, lowp, lo, hi); });
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace infinity::cpu
