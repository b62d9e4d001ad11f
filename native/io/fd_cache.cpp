#include "fd_cache.hpp"

#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "file.hpp"

namespace infinity::io {

FdCache::FdCache(size_t capacity) : capacity_(capacity), errors_(std::make_shared<CloseErrors>()) {
  struct rlimit lim;
  if (::getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY)
    capacity_ = std::min<size_t>(capacity_, static_cast<size_t>(lim.rlim_cur / 4));
}

OpenFile::~OpenFile() {
  if (fd < 0) return;
  if (::close(fd) != 0 && write && errno != EINTR && errors) {
    const int err = errno;
    std::lock_guard<std::mutex> lk(errors->mu);
    if (errors->first.err == 0) errors->first = ErrorInfo{err, path, 0, "close after write failed"};
  }
}

std::shared_ptr<OpenFile> FdCache::open_new(const std::string& path, bool write, bool direct, int* err) {
  int fd = open_file(path, write, direct);
  if (fd == -EMFILE || fd == -ENFILE) {
    // Out of descriptors: give back the ones only this cache holds, then try once more.
    {
      std::lock_guard<std::mutex> lk(mu_);
      lru_.clear();
      index_.clear();
    }
    fd = open_file(path, write, direct);
  }
  if (fd < 0) {
    *err = -fd;
    return nullptr;
  }
  auto f = std::make_shared<OpenFile>();
  f->fd = fd;
  f->write = write;
  f->path = path;
  f->errors = errors_;
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    *err = errno;
    return nullptr;  // f's destructor closes fd
  }
  f->dev = st.st_dev;
  f->ino = st.st_ino;
  if (direct) f->align = direct_alignment(fd);
  ++opens_;
  return f;
}

std::shared_ptr<OpenFile> FdCache::get(const std::string& path, bool write, bool direct, int* err) {
  std::string key = path;
  key.push_back('\0');
  key.push_back(write ? 'w' : 'r');
  key.push_back(direct ? 'd' : 'b');
  if (capacity_ > 0) {
    struct stat st;
    bool exists = ::stat(path.c_str(), &st) == 0;
    std::lock_guard<std::mutex> lk(mu_);
    auto it = index_.find(key);
    if (it != index_.end()) {
      std::shared_ptr<OpenFile> f = it->second->file;
      if (exists && f->dev == st.st_dev && f->ino == st.st_ino) {
        lru_.splice(lru_.begin(), lru_, it->second);
        return f;
      }
      lru_.erase(it->second);  // replaced or removed since it was opened
      index_.erase(it);
    }
  }
  if (capacity_ > 0) {
    // [Note: cached fds never keep a deleted file] A cached fd keeps its file's blocks allocated after the
    // file is removed (a rotated checkpoint, a replaced swap file) until the fd closes: on a full disk the
    // next write then fails with ENOSPC although the space was "freed". So before opening another file
    // (the moment new space may be needed) the cache drops every entry whose file has no name left
    // (st_nlink 0); its fd closes once no request holds it. An fstat per cached fd, on misses only: a run's
    // swap files fit the cache (1024), so misses are rare, and each costs an open(2) anyway. The dropped
    // entries are let go after the lock: closing the last fd of a large removed file frees its blocks, which
    // can take a while, and other threads' lookups must not wait for it.
    std::vector<std::shared_ptr<OpenFile>> dropped;
    {
      std::lock_guard<std::mutex> lk(mu_);
      drop_unlinked_locked(&dropped);
    }
  }
  std::shared_ptr<OpenFile> f = open_new(path, write, direct, err);
  if (!f || capacity_ == 0) return f;
  std::lock_guard<std::mutex> lk(mu_);
  auto it = index_.find(key);
  if (it != index_.end()) {  // another thread opened it meanwhile: keep the newer
    lru_.erase(it->second);
    index_.erase(it);
  }
  lru_.push_front(Entry{key, f});
  index_[key] = lru_.begin();
  while (lru_.size() > capacity_) {
    index_.erase(lru_.back().key);
    lru_.pop_back();
  }
  return f;
}

void FdCache::drop_unlinked_locked(std::vector<std::shared_ptr<OpenFile>>* dropped) {
  for (auto it = lru_.begin(); it != lru_.end();) {
    struct stat st;
    // A failed fstat (it cannot fail on an open fd short of EOVERFLOW) keeps the entry: get() re-checks
    // the path's identity before every reuse anyway.
    if (::fstat(it->file->fd, &st) == 0 && st.st_nlink == 0) {
      dropped->push_back(std::move(it->file));
      index_.erase(it->key);
      it = lru_.erase(it);
    } else {
      ++it;
    }
  }
}

void FdCache::forget(const std::string& path) {
  std::lock_guard<std::mutex> lk(mu_);
  for (const char* kind : {"rd", "rb", "wd", "wb"}) {
    std::string key = path;
    key.push_back('\0');
    key += kind;
    auto it = index_.find(key);
    if (it == index_.end()) continue;
    lru_.erase(it->second);
    index_.erase(it);
  }
}

ErrorInfo FdCache::clear() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    lru_.clear();
    index_.clear();
  }
  std::lock_guard<std::mutex> lk(errors_->mu);
  ErrorInfo e = errors_->first;
  errors_->first = ErrorInfo{};
  return e;
}

size_t FdCache::size() {
  std::lock_guard<std::mutex> lk(mu_);
  return lru_.size();
}

}  // namespace infinity::io
