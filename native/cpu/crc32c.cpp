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

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("sse4.2"))) uint32_t crc32c_hw(const unsigned char* p, size_t n, uint32_t crc) {
  uint64_t c = ~crc;
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
    c = __builtin_ia32_crc32qi(static_cast<uint32_t>(c), *p++);
    --n;
  }
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = __builtin_ia32_crc32di(c, v);
  }
  while (n--) c = __builtin_ia32_crc32qi(static_cast<uint32_t>(c), *p++);
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

uint32_t crc32c(const void* data, size_t n, uint32_t crc) {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool hw = has_sse42();
  if (hw) return crc32c_hw(static_cast<const unsigned char*>(data), n, crc);
#endif
  return crc32c_portable(data, n, crc);
}

}  // namespace infinity::cpu
