// A bounded cache of open file descriptors, shared by one Handle's requests.
//
// [Note: cached file descriptors]
// Opening a file with O_DIRECT, and the statx that finds its alignment,
// cost tens to hundreds of microseconds: on a swap step that reads and
// writes hundreds of files that time is on the step thread's critical path.
// The cache keeps up to `capacity` fds per handle (and at most a quarter of
// the process's fd limit), keyed by (path, write, direct), least recently
// used dropped first; an open that still finds no fd free empties it and
// tries again. It stays correct when a file
// is replaced: every lookup stats the path and compares (device, inode) with
// the cached fd's, so a file renamed over or removed and re-created is
// opened again (the old fd closes once the requests using it finish). A
// file truncated in place keeps its inode and its fd, which sees the new
// size. A cached fd keeps a removed file's blocks allocated, so code that
// removes a file it wrote calls Handle::forget(path) first (the swapper
// does), and a file removed by anyone else is dropped at the next miss
// ([Note: cached fds never keep a deleted file] in fd_cache.cpp);
// Handle::close() closes every fd. Because a cached fd of a written
// file is closed later than its request, an error that close() reports
// (possible on network filesystems) is kept and raised by Handle::close(),
// not by the request; local filesystems report write errors at completion.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "io_error.hpp"

namespace infinity::io {

struct OpenFile;

// Where fds that close after their request record a close error.
struct CloseErrors {
  std::mutex mu;
  ErrorInfo first;
};

struct OpenFile {
  int fd = -1;
  bool write = false;
  dev_t dev = 0;
  ino_t ino = 0;
  size_t align = 1;  // opened with O_DIRECT: its alignment (direct_alignment; 0 if the filesystem has none)
  std::string path;
  std::shared_ptr<CloseErrors> errors;
  ~OpenFile();  // closes fd; a failed close of a written fd goes to `errors`
};

class FdCache {
 public:
  // At most `capacity` fds, and never more than a quarter of RLIMIT_NOFILE's soft limit.
  explicit FdCache(size_t capacity);

  // An open fd for (path, write, direct): cached, or opened now (and cached
  // when the capacity is > 0). Returns nullptr and sets *err to an errno on
  // failure.
  std::shared_ptr<OpenFile> get(const std::string& path, bool write, bool direct, int* err);

  // Drops the entries of `path` (call before removing the file, so that its
  // space is freed once the requests using it finish, not at close()).
  void forget(const std::string& path);

  // Drops every entry (fds close once no request holds them). Returns the
  // first close error of a written fd since the last clear(), if any.
  ErrorInfo clear();

  size_t size();
  size_t capacity() const { return capacity_; }
  uint64_t opens() const { return opens_.load(); }

 private:
  struct Entry {
    std::string key;
    std::shared_ptr<OpenFile> file;
  };
  std::shared_ptr<OpenFile> open_new(const std::string& path, bool write, bool direct, int* err);
  // mu_ held: moves the entries whose file has no name left into *dropped (see get())
  void drop_unlinked_locked(std::vector<std::shared_ptr<OpenFile>>* dropped);

  size_t capacity_;
  std::shared_ptr<CloseErrors> errors_;
  std::mutex mu_;
  std::list<Entry> lru_;  // most recently used first
  std::unordered_map<std::string, std::list<Entry>::iterator> index_;
  std::atomic<uint64_t> opens_{0};
};

}  // namespace infinity::io
