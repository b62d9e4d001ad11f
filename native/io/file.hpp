// File helpers for the I/O layer. They return -errno and never throw.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace infinity::io {

// Opens `path` for reading or writing (created 0644 if missing, never
// truncated). With direct=true the fd uses O_DIRECT. Returns fd or -errno.
int open_file(const std::string& path, bool write, bool direct);

// O_DIRECT alignment of an fd: the larger of the page size and the offset
// alignment the filesystem reports through statx(STATX_DIOALIGN). Falls back
// to the page size on kernels that do not report it. Returns 0 when the
// filesystem says it does not support direct I/O.
size_t direct_alignment(int fd);

// Same, for a directory or file path (used by `infinity info`); -errno on error.
int64_t direct_alignment_of_path(const std::string& path);

// Size in bytes, or -errno.
int64_t file_size(int fd);

size_t page_size();

// Memory aligned to `alignment`, released with std::free. nullptr on failure.
void* aligned_alloc_bytes(size_t nbytes, size_t alignment);

}  // namespace infinity::io
