#include "file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

namespace infinity::io {

static int open_retrying(const std::string& path, int flags) {
  int fd;
  do {
    fd = ::open(path.c_str(), flags, 0644);
  } while (fd < 0 && errno == EINTR);
  return fd < 0 ? -errno : fd;
}

// [Note: a refused O_DIRECT open leaves no file]
// Linux creates a missing file before it finds that the filesystem refuses
// O_DIRECT (ramfs, older tmpfs: EINVAL), so one open(O_CREAT | O_DIRECT) there
// leaves an empty file behind (a 0-byte .swp in a ramfs nvme_path). So a
// write opens an existing file without O_CREAT, and creates a missing one
// with O_EXCL: then the file is known to be this call's, and a refused open
// removes it again.
int open_file(const std::string& path, bool write, bool direct) {
  int flags = O_CLOEXEC | (write ? O_WRONLY : O_RDONLY);
  if (direct) flags |= O_DIRECT;
  int fd = open_retrying(path, flags);
  // Another opener may create the file between the two opens (EEXIST), or
  // create it and remove it again (its open refused: ENOENT); a few turns
  // settle either.
  for (int turn = 0; write && fd == -ENOENT && turn < 8; ++turn) {
    fd = open_retrying(path, flags | O_CREAT | O_EXCL);
    if (fd == -EINVAL && direct) {
      // The open's EINVAL is the error to report: a failed unlink only
      // leaves the empty file, as before this check.
      (void)::unlink(path.c_str());
      return fd;
    }
    if (fd == -EEXIST) fd = open_retrying(path, flags);
  }
  return fd;
}

size_t page_size() {
  long p = ::sysconf(_SC_PAGESIZE);
  return p > 0 ? static_cast<size_t>(p) : 4096;
}

static int64_t dio_align_from_statx(int dirfd, const char* path, int flags) {
#if defined(STATX_DIOALIGN)
  struct statx st;
  std::memset(&st, 0, sizeof(st));
  if (::statx(dirfd, path, flags, STATX_DIOALIGN, &st) != 0) return -errno;
  if (!(st.stx_mask & STATX_DIOALIGN)) return static_cast<int64_t>(page_size());
  if (st.stx_dio_offset_align == 0) return 0;  // filesystem has no direct I/O
  size_t a = page_size();
  if (st.stx_dio_offset_align > a) a = st.stx_dio_offset_align;
  if (st.stx_dio_mem_align > a) a = st.stx_dio_mem_align;
  return static_cast<int64_t>(a);
#else
  (void)dirfd;
  (void)path;
  (void)flags;
  return static_cast<int64_t>(page_size());
#endif
}

size_t direct_alignment(int fd) {
  int64_t a = dio_align_from_statx(fd, "", AT_EMPTY_PATH);
  // A statx failure on an open fd is not fatal: the page size is always a
  // safe alignment on Linux.
  return a < 0 ? page_size() : static_cast<size_t>(a);
}

int64_t direct_alignment_of_path(const std::string& path) {
  return dio_align_from_statx(AT_FDCWD, path.c_str(), 0);
}

int64_t file_size(int fd) {
  struct stat st;
  if (::fstat(fd, &st) != 0) return -errno;
  return static_cast<int64_t>(st.st_size);
}

void* aligned_alloc_bytes(size_t nbytes, size_t alignment) {
  void* p = nullptr;
  // posix_memalign returns the error instead of setting errno.
  if (::posix_memalign(&p, alignment, nbytes == 0 ? alignment : nbytes) != 0) return nullptr;
  return p;
}

}  // namespace infinity::io
