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

__attribute__((target_clones("avx512f", "avx2", "default")))
void traffic(float* __restrict p, const float* __restrict g, float* __restrict m, float* __restrict v,
             uint16_t* __restrict lowp, size_t lo, size_t hi) {
  if (lowp) {
    for (size_t i = lo; i < hi; ++i) {
      float x = p[i] + g[i];
      p[i] = x;
      m[i] += g[i];
      v[i] += g[i];
      uint32_t u;
      std::memcpy(&u, &x, 4);
      lowp[i] = static_cast<uint16_t>(u >> 16);
    }
  } else {
    for (size_t i = lo; i < hi; ++i) {
      p[i] += g[i];
      m[i] += g[i];
      v[i] += g[i];
    }
  }
}

}  // namespace

double stream_adam_traffic(float* p, const float* g, float* m, float* v, uint16_t* lowp, size_t n, int repeats) {
  auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < repeats; ++r)
    parallel_for(n, 64, 1 << 15, [&](size_t lo, size_t hi) { traffic(p, g, m, v, lowp, lo, hi); });
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace infinity::cpu
