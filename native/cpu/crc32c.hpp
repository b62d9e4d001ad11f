// CRC-32C (Castagnoli), the checksum of swapped partitions. SSE4.2's crc32
// instruction where the CPU has it (about 8 bytes per 3 cycles per stream,
// three streams interleaved), a table otherwise. Standard values: crc32c of
// "123456789" is 0xE3069283.
#pragma once

#include <cstddef>
#include <cstdint>

namespace infinity::cpu {

uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0);
uint32_t crc32c_portable(const void* data, size_t n, uint32_t crc = 0);
// crc32c(A || B) from crc_a = crc32c(A) and crc_b = crc32c(B), both from seed 0,
// and len_b = |B|, without touching the bytes (O(log len_b) work).
uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);

}  // namespace infinity::cpu
