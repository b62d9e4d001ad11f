// Run-time CPU feature detection, shared by `infinity info` and the CPU Adam
// kernels. INFINITY_SIMD=scalar|avx2|avx512 caps the level for tests.
#pragma once

namespace infinity::cpu {

// kAvx512Bf16: AVX-512 plus AVX512_BF16, whose VCVTNE2PS2BF16 rounds bf16 Adam moments (nearest) two
// vectors per instruction; everything else runs the kAvx512 code.
enum class SimdLevel { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };

SimdLevel detected_simd();     // what the CPU supports
SimdLevel active_simd();       // detected, capped by INFINITY_SIMD
const char* simd_name(SimdLevel level);
bool cpu_has_avx512_bf16();

}  // namespace infinity::cpu
