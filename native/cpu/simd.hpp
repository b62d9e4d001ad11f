// Run-time CPU feature detection, shared by `infinity info` and the CPU Adam
// kernels. INFINITY_SIMD=scalar|avx2|avx512 caps the level for tests.
#pragma once

namespace infinity::cpu {

enum class SimdLevel { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

SimdLevel detected_simd();     // what the CPU supports
SimdLevel active_simd();       // detected, capped by INFINITY_SIMD
const char* simd_name(SimdLevel level);
bool cpu_has_avx512_bf16();

}  // namespace infinity::cpu
