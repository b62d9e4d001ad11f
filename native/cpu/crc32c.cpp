#include "crc32c.hpp"

#include <cstring>

namespace infinity::cpu {
namespace {

struct Table {
  uint32_t t[256];
  Table() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));  // reflected polynomial
      t[i] = c;
    }
  }
};

const Table& table() {
  static const Table tab;
  return tab;
}

// Multiplication of two polynomials mod P, in the reflected bit order the
// CRC register uses (bit 31 holds x^0, bit 0 holds x^31). Shifting right by
// one multiplies by x; a bit falling off the end is reduced by the polynomial.
uint32_t gf2_mul(uint32_t a, uint32_t b) {
  uint32_t prod = 0;
  for (int i = 0; i < 32; ++i) {
    if (a & 0x80000000u) prod ^= b;
    a <<= 1;
    b = (b >> 1) ^ (0x82F63B78u & (0u - (b & 1u)));
  }
  return prod;
}

// x^(8n) mod P: what a register is multiplied by when n zero bytes pass through it.
uint32_t x_pow_8n(uint64_t n) {
  uint32_t result = 0x80000000u, base = 0x00800000u;  // x^0, x^8
  for (; n; n >>= 1) {
    if (n & 1) result = gf2_mul(result, base);
    base = gf2_mul(base, base);
  }
  return result;
}

#if defined(__x86_64__) && defined(__GNUC__)
// [Note: three CRC lanes]
// The crc32 instruction takes 3 cycles but can start one per cycle, so one
// dependent chain runs at a third of the core's rate. Each chunk is cut into
// three lanes of kLane bytes, run as three independent chains from zero and
// joined with the identity crc(s, A||B) = crc(s, A) * x^(8|B|) xor crc(0, B)
// (on the raw register, before the final inversion).
constexpr size_t kLane = 4096;

__attribute__((target("sse4.2"))) uint64_t crc_run(uint64_t c, const unsigned char* p, size_t n) {
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = __builtin_ia32_crc32di(c, v);
  }
  while (n--) c = __builtin_ia32_crc32qi(static_cast<uint32_t>(c), *p++);
  return c;
}

__attribute__((target("sse4.2"))) uint32_t crc32c_hw(const unsigned char* p, size_t n, uint32_t crc) {
  static const uint32_t shift = x_pow_8n(kLane);
  uint64_t c = static_cast<uint32_t>(~crc);
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
    c = __builtin_ia32_crc32qi(static_cast<uint32_t>(c), *p++);
    --n;
  }
  for (; n >= 3 * kLane; n -= 3 * kLane, p += 3 * kLane) {
    uint64_t c0 = c, c1 = 0, c2 = 0;
    for (size_t i = 0; i < kLane; i += 8) {
      uint64_t v0, v1, v2;
      std::memcpy(&v0, p + i, 8);
      std::memcpy(&v1, p + kLane + i, 8);
      std::memcpy(&v2, p + 2 * kLane + i, 8);
      c0 = __builtin_ia32_crc32di(c0, v0);
      c1 = __builtin_ia32_crc32di(c1, v1);
      c2 = __builtin_ia32_crc32di(c2, v2);
    }
    // Join the three lanes: see [Note: three CRC lanes].
    uint32_t joined = gf2_mul(static_cast<uint32_t>(c0), shift) ^ static_cast<uint32_t>(c1);
    c = gf2_mul(joined, shift) ^ static_cast<uint32_t>(c2);
  }
  c = crc_run(c, p, n);
  return ~static_cast<uint32_t>(c);
}

bool has_sse42() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("sse4.2");
}
#endif

}  // namespace

uint32_t crc32c_portable(const void* data, size_t n, uint32_t crc) {
  const unsigned char* p = static_cast<const unsigned char*>(data);
  const Table& tab = table();
  crc = ~crc;
  while (n--) crc = (crc >> 8) ^ tab.t[(crc ^ *p++) & 0xffu];
  return ~crc;
}

// [Note: combining finished CRCs]
// The register update is linear: feeding B to register s gives
// s * x^(8|B|) xor f(0, B). A finished CRC is the register inverted, and both
// A and B start from the inverted zero, so the inversions cancel:
// crc(A||B) xor crc(B) = (R_A xor ~0) * x^(8|B|) = crc(A) * x^(8|B|).
uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
  return gf2_mul(crc_a, x_pow_8n(len_b)) ^ crc_b;
}

uint32_t crc32c(const void* data, size_t n, uint32_t crc) {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool hw = has_sse42();
  if (hw) return crc32c_hw(static_cast<const unsigned char*>(data), n, crc);
#endif
  return crc32c_portable(data, n, crc);
}

}  // namespace infinity::cpu
