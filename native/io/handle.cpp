#include "handle.hpp"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>

#include "../cpu/crc32c.hpp"
#include "fault.hpp"
#include "file.hpp"

namespace infinity::io {

namespace {
constexpr int kReapTimeoutMs = 100;  // a worker re-checks for shutdown this often
constexpr int kMaxNoProgress = 8;    // zero-progress retries before a chunk fails
constexpr size_t kMaxBlock = 1u << 30;  // io_uring lengths are 32-bit

size_t round_down(size_t x, size_t a) { return x / a * a; }
size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

ErrorInfo make_error(int err, const std::string& path, int64_t offset, std::string what) {
  return ErrorInfo{err, path, offset, std::move(what)};
}

// The kernel gave up on this attempt without failing it: go again, not an error.
bool transient(int64_t res) { return res == -EINTR || res == -EAGAIN; }
}  // namespace

// ---------------------------------------------------------------- Request

Request::Request(Handle* handle, bool write, std::string path, int64_t offset, size_t nbytes)
    : handle_(handle), write_(write), path_(std::move(path)), offset_(offset), nbytes_(nbytes) {}

Request::~Request() = default;  // a request that never ran lets go of its fds here

bool Request::wait(double timeout_s) {
  std::unique_lock<std::mutex> lk(mu_);
  // Negative, non-finite or absurdly long timeouts mean "forever": a huge
  // double would overflow the clock's integer duration.
  if (timeout_s < 0 || !(timeout_s < 1e9)) {
    cv_.wait(lk, [&] { return done_; });
    return true;
  }
  return cv_.wait_for(lk, std::chrono::duration<double>(timeout_s), [&] { return done_; });
}

bool Request::done() {
  std::lock_guard<std::mutex> lk(mu_);
  return done_;
}

size_t Request::result() {
  std::lock_guard<std::mutex> lk(mu_);
  if (!done_) throw ArgumentError("result() called before the request finished; call wait() first");
  if (error_.err != 0) throw IoError(error_);
  return nbytes_;
}

uint32_t Request::crc32c() {
  std::lock_guard<std::mutex> lk(mu_);
  if (!checksum_)
    throw ArgumentError("crc32c(): this request was not submitted with checksum=True (path " + path_ + ")");
  if (!done_) throw ArgumentError("crc32c() called before the request finished; call wait() first");
  if (error_.err != 0) throw IoError(error_);
  return crc_;
}

void Request::chunk_finished(const ErrorInfo* err) {
  if (err) {
    std::lock_guard<std::mutex> lk(mu_);
    // The first failure is the one reported; later ones are its echoes.
    if (error_.err == 0) error_ = *err;
    failed_.store(true);
  }
  if (unfinished_.fetch_sub(1) == 1) complete();
}

void Request::complete() {
  // A deferred write error (e.g. on network filesystems) can show up at
  // close(), so when this request is the last holder of a written fd (not
  // cached), it closes it here and a failed close fails the request. A
  // cached fd closes later (see [Note: cached file descriptors]).
  for (std::shared_ptr<OpenFile>* f : {&file_direct_, &file_buffered_}) {
    if (!*f) continue;
    if (f->use_count() == 1 && (*f)->fd >= 0) {
      int fd = (*f)->fd;
      (*f)->fd = -1;
      if (::close(fd) != 0 && write_ && errno != EINTR) {
        std::lock_guard<std::mutex> lk(mu_);
        if (error_.err == 0) error_ = make_error(errno, path_, offset_, "close after write failed");
      }
    }
    f->reset();
  }
  bool ok;
  {
    std::lock_guard<std::mutex> lk(mu_);
    ok = error_.err == 0;
  }
  // See [Note: checksum on completion]; the lock is not held over the bytes (nothing reads crc_ before done_).
  if (ok && checksum_) crc_ = infinity::cpu::crc32c(buf_, nbytes_);
  // Byte counters first, so a waiter that wakes up sees them updated.
  if (ok) (write_ ? handle_->bytes_written_ : handle_->bytes_read_).fetch_add(nbytes_);
  {
    std::lock_guard<std::mutex> lk(mu_);
    done_ = true;
  }
  cv_.notify_all();
  handle_->release_inflight();
  // Last: this may destroy the Request (see [Note: request lifetime]).
  std::shared_ptr<Request> keep = std::move(self_);
}

// ---------------------------------------------------------------- Worker

// One worker thread's engine and loop state. Only that thread touches it
// once the loop has started.
struct Handle::Worker {
  explicit Worker(Handle& handle) : h(handle) {}
  ~Worker() {
    for (Slot& s : slots) std::free(s.mem);
  }

  Handle& h;
  std::unique_ptr<Engine> engine;
  std::thread thread;
  // Bounce buffers for pieces whose user memory is not O_DIRECT-aligned; one
  // slot per chunk the engine can hold, so a slot is always free.
  struct Slot {
    char* mem = nullptr;
    size_t size = 0;
    size_t align = 0;
  };
  std::vector<Slot> slots;
  std::vector<int> free_slots;

  std::vector<Chunk*> batch;  // what this turn of the loop submits
  std::deque<Chunk*> retry;   // accepted earlier, need (re)submission
  std::vector<Completion> comps;
  int cap = 0;       // chunks the engine can hold
  int inflight = 0;  // chunks the engine holds now

  void start(std::unique_ptr<Engine> e) {
    engine = std::move(e);
    cap = engine->capacity();
    slots.resize(cap);
    for (int s = cap - 1; s >= 0; --s) free_slots.push_back(s);
    comps.resize(cap);
  }

  bool gather();
  void prepare();
  void submit_batch();
  void wait_before_retry();
  void reap();
  void settle(Chunk* c, int64_t raw);
  void retry_short(Chunk* c, size_t before);
  void finish(Chunk* c);
  void fail(Chunk* c, int err, const char* what);
  void take_from(std::deque<Chunk*>& from, bool refill);
  bool attach_bounce(Chunk* c);
  void release_bounce(Chunk* c);
};

// Fills the batch, retries first (they were accepted earlier); blocks while
// idle and returns false once the handle is stopping and nothing is left.
bool Handle::Worker::gather() {
  batch.clear();
  // Without overlap_events a worker submits only into an empty queue:
  // a batch goes out, and all of it completes before the next one.
  const bool refill = h.opts_.overlap_events || inflight == 0;
  take_from(retry, refill);
  std::unique_lock<std::mutex> lk(h.queue_mu_);
  if (inflight == 0 && batch.empty())
    h.queue_cv_.wait(lk, [&] { return !h.queue_.empty() || h.stopping_; });
  if (h.stopping_ && h.queue_.empty() && inflight == 0 && batch.empty()) return false;
  take_from(h.queue_, refill);
  return true;
}

// Moves chunks from the front of `from` while the engine has room for them.
void Handle::Worker::take_from(std::deque<Chunk*>& from, bool refill) {
  while (refill && !from.empty() && inflight + static_cast<int>(batch.size()) < cap) {
    batch.push_back(from.front());
    from.pop_front();
  }
}

// Drops pieces of requests that already failed (their outcome is decided and
// the I/O would only waste bandwidth) and gives unaligned pieces a bounce buffer.
void Handle::Worker::prepare() {
  size_t keep = 0;
  for (Chunk* c : batch) {
    if (c->req->failed_.load()) {
      release_bounce(c);
      c->req->chunk_finished(nullptr);
      continue;
    }
    if (c->user && c->bounce_slot < 0 && !attach_bounce(c)) {
      fail(c, ENOMEM, "cannot allocate an aligned bounce buffer");
      continue;
    }
    batch[keep++] = c;
  }
  batch.resize(keep);
}

// Hands the batch to the engine as far as it takes it; the rest goes back to
// the front of the retry queue, in order, for after the next reap.
void Handle::Worker::submit_batch() {
  size_t pos = 0;
  while (pos < batch.size()) {
    const int want = h.opts_.single_submit ? 1 : static_cast<int>(batch.size() - pos);
    int r = engine->submit(batch.data() + pos, want);
    h.submit_calls_.fetch_add(1, std::memory_order_relaxed);
    if (transient(r) || r == 0) break;  // the kernel is busy: reap, then retry
    if (r < 0) {
      // The error belongs to the first chunk offered; the rest may be fine.
      fail(batch[pos], -r, "submit failed");
      ++pos;
      continue;
    }
    inflight += r;
    pos += static_cast<size_t>(r);
  }
  for (size_t i = batch.size(); i > pos; --i) retry.push_front(batch[i - 1]);
}

// Nothing of ours is in flight, so there is nothing to reap: pause briefly
// before resubmitting what the kernel turned away.
void Handle::Worker::wait_before_retry() {
  if (!retry.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

// Waits a bounded time (so a stopping handle is noticed) and settles what completed.
void Handle::Worker::reap() {
  int got = engine->reap(comps.data(), cap, kReapTimeoutMs);
  if (got < 0) {
    // EINTR is routine; anything else means the kernel could not report,
    // but the chunks are still its to finish, so keep waiting for them.
    if (got != -EINTR) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return;
  }
  for (int i = 0; i < got; ++i) {
    --inflight;
    settle(comps[i].chunk, comps[i].res);
  }
}

// Turns one completion into the chunk's next step: finished, failed or retried.
void Handle::Worker::settle(Chunk* c, int64_t raw) {
  const int64_t res = apply_fault(raw, c->remaining());
  if (transient(res)) {
    retry.push_back(c);
  } else if (res < 0) {
    fail(c, static_cast<int>(-res), c->write ? "write failed" : "read failed");
  } else if (res == 0) {
    if (c->write)
      fail(c, EIO, "write made no progress");
    else
      fail(c, ENODATA, "unexpected end of file: the file shrank while it was being read");
  } else {
    const size_t before = c->done;
    c->done += static_cast<size_t>(res);
    if (c->done < c->len)
      retry_short(c, before);
    else
      finish(c);
  }
}

// A short transfer is legal; requeue the rest, but fail a chunk that hit end
// of file or stopped making progress rather than retry it forever.
void Handle::Worker::retry_short(Chunk* c, size_t before) {
  // O_DIRECT needs an aligned offset, so the partial unit is moved again
  // (harmless for reads and writes).
  if (c->align > 1) {
    if (!c->write && c->done % c->align != 0) {
      // A direct read only ends off-alignment at end of file.
      fail(c, ENODATA, "short read: the file ends inside this request");
      return;
    }
    c->done = round_down(c->done, c->align);
  }
  if (c->done <= before && ++c->stalls > kMaxNoProgress) {
    fail(c, EIO, c->write ? "write made no progress after repeated short writes"
                          : "read made no progress after repeated short reads");
    return;
  }
  retry.push_back(c);
}

// All bytes moved: hand a read's bounce copy to the user and tell the request.
void Handle::Worker::finish(Chunk* c) {
  if (c->bounce_slot >= 0 && !c->write) std::memcpy(c->user, c->buf, c->len);
  release_bounce(c);
  c->req->chunk_finished(nullptr);
}

// Records the chunk's error (-errno from below becomes an ErrorInfo here; the
// Request throws it at the API edge) and retires the chunk.
void Handle::Worker::fail(Chunk* c, int err, const char* what) {
  ErrorInfo e = make_error(err, c->req->path_, c->cur_off(), what);
  release_bounce(c);
  c->req->chunk_finished(&e);
}

// Returns false when memory for the bounce buffer cannot be had.
bool Handle::Worker::attach_bounce(Chunk* c) {
  int idx = free_slots.back();
  Slot& s = slots[idx];
  if (s.size < c->len || s.align < c->align) {
    std::free(s.mem);
    s.mem = static_cast<char*>(aligned_alloc_bytes(c->len, c->align));
    s.size = s.mem ? c->len : 0;
    s.align = s.mem ? c->align : 0;
    if (!s.mem) return false;
  }
  free_slots.pop_back();
  c->bounce_slot = idx;
  c->buf = s.mem;
  if (c->write) std::memcpy(c->buf, c->user, c->len);
  return true;
}

// Gives the chunk's bounce slot back for the next unaligned chunk.
void Handle::Worker::release_bounce(Chunk* c) {
  if (c->bounce_slot < 0) return;
  free_slots.push_back(c->bounce_slot);
  c->bounce_slot = -1;
  c->buf = nullptr;
}

// ---------------------------------------------------------------- Handle

Handle::Handle(const HandleOptions& opts) : opts_(opts), fds_(opts.fd_cache) {
  if (opts.block_size == 0 || opts.block_size % 4096 != 0 || opts.block_size > kMaxBlock)
    throw ArgumentError("block_size must be a multiple of 4096 in [4096, 1 GiB], got " +
                        std::to_string(opts.block_size));
  if (opts.queue_depth < 1 || opts.queue_depth > 4096)
    throw ArgumentError("queue_depth must be in [1, 4096], got " + std::to_string(opts.queue_depth));
  if (opts.threads < 1 || opts.threads > 256)
    throw ArgumentError("threads must be in [1, 256], got " + std::to_string(opts.threads));
  if (!backend_compiled(opts.backend))
    throw ArgumentError(std::string("backend '") + backend_name(opts.backend) +
                        "' was not compiled into this build (its headers were missing); "
                        "see infinity.io.available_backends()");
  // Engines start here, on the caller's thread, so a refusal (io_uring
  // blocked by seccomp, aio-max-nr exhausted) is an exception now rather than
  // a dead worker later.
  for (int i = 0; i < opts.threads; ++i) {
    int err = 0;
    std::unique_ptr<Engine> engine = make_engine(opts.backend, opts.queue_depth, &err);
    if (!engine)
      throw IoError(make_error(err, "", -1, std::string("could not start the ") + backend_name(opts.backend) +
                                                " engine (queue_depth " + std::to_string(opts.queue_depth) + ")"));
    auto w = std::make_unique<Worker>(*this);
    w->start(std::move(engine));
    workers_.push_back(std::move(w));
  }
  for (auto& w : workers_) {
    Worker* raw = w.get();
    raw->thread = std::thread([this, raw] { worker_loop(raw); });
  }
}

Handle::~Handle() { shutdown(); }  // a close error here has no one to go to

void Handle::close() {
  ErrorInfo e = shutdown();
  if (e.err != 0) throw IoError(e);
}

ErrorInfo Handle::shutdown() {
  // Serialised, so a second caller returns only once the workers are gone.
  std::lock_guard<std::mutex> serial(close_mu_);
  {
    // Under queue_mu_: submit() checks closed_ and counts itself in flight
    // under the same lock, so every request either is refused or is waited for.
    std::lock_guard<std::mutex> lk(queue_mu_);
    closed_.store(true);
  }
  wait_all();
  ErrorInfo closed_with = fds_.clear();  // no request holds an fd any more: every cached one closes now
  {
    std::lock_guard<std::mutex> lk(queue_mu_);
    if (stopping_) return closed_with;
    stopping_ = true;
  }
  queue_cv_.notify_all();
  for (auto& w : workers_)
    if (w->thread.joinable()) w->thread.join();
  return closed_with;
}

void Handle::wait_all() {
  std::unique_lock<std::mutex> lk(idle_mu_);
  idle_cv_.wait(lk, [&] { return inflight_.load() == 0; });
}

void Handle::release_inflight() {
  // Decrement under the lock so close() cannot return (and free this Handle)
  // between the decrement and the notify.
  std::lock_guard<std::mutex> lk(idle_mu_);
  inflight_.fetch_sub(1);
  idle_cv_.notify_all();
}

std::shared_ptr<Request> Handle::submit(bool write, void* buf, size_t nbytes, const std::string& path,
                                        int64_t offset, bool checksum) {
  if (offset < 0)
    throw ArgumentError("offset must be >= 0, got " + std::to_string(offset) + " (path " + path + ")");
  if (path.empty()) throw ArgumentError("path must not be empty");
  // open(2) reads a C string: a path with a NUL in it would silently name the file cut at the NUL.
  if (path.find('\0') != std::string::npos)
    throw ArgumentError("path contains a NUL byte (open() would use only the part before it): " +
                        path.substr(0, path.find('\0')) + "\\0...");
  if (nbytes > 0 && buf == nullptr) throw ArgumentError("buffer pointer is null (path " + path + ")");
  if (checksum && write)
    throw ArgumentError("checksum is for reads: a write's caller has its bytes (path " + path + ")");

  {
    std::lock_guard<std::mutex> lk(queue_mu_);
    if (closed_.load()) throw ArgumentError("I/O handle is closed; create a new AsyncIO");
    inflight_.fetch_add(1);
  }
  auto req = std::make_shared<Request>(this, write, path, offset, nbytes);
  req->buf_ = static_cast<char*>(buf);
  req->checksum_ = checksum;
  try {
    plan(*req, static_cast<char*>(buf));
  } catch (...) {
    release_inflight();
    throw;
  }
  req->self_ = req;
  req->unfinished_.store(req->chunks_.size());
  if (req->chunks_.empty()) {
    req->complete();
    return req;
  }
  {
    std::lock_guard<std::mutex> lk(queue_mu_);
    for (Chunk& c : req->chunks_) queue_.push_back(&c);
  }
  queue_cv_.notify_all();
  return req;
}

// Splits [offset, offset+nbytes) into chunks. With O_DIRECT the unaligned
// head and tail (each under one alignment unit) go through a second, buffered
// fd: the kernel merges those bytes at any granularity, so two requests that
// share an alignment unit never race on a read-modify-write of our own. The
// alignment unit is at least a page, so buffered and direct bytes never share
// a page-cache page.
void Handle::plan(Request& req, char* buf) {
  const std::string& path = req.path_;
  const int64_t off = req.offset_;
  const size_t n = req.nbytes_;

  auto open_or_throw = [&](bool direct) {
    int err = 0;
    std::shared_ptr<OpenFile> f = fds_.get(path, req.write_, direct, &err);
    if (f) return f;
    std::string what = std::string("cannot open for ") + (req.write_ ? "writing" : "reading");
    if (direct && err == EINVAL)
      what += ": the filesystem does not support O_DIRECT; pass direct=False or use a directory on a "
              "real disk";
    throw IoError(make_error(err, path, off, what));
  };

  std::shared_ptr<OpenFile> main_file = open_or_throw(opts_.direct);
  (opts_.direct ? req.file_direct_ : req.file_buffered_) = main_file;
  const int fd_main = main_file->fd;
  size_t align = 1;
  if (opts_.direct) {
    align = main_file->align;  // found once per open file
    if (align == 0)
      throw IoError(make_error(EINVAL, path, off,
                               "the filesystem does not support O_DIRECT; pass direct=False"));
  }
  if (!req.write_) {
    int64_t size = file_size(fd_main);
    if (size < 0) throw IoError(make_error(static_cast<int>(-size), path, off, "fstat failed"));
    if (n > 0 && static_cast<uint64_t>(off) + n > static_cast<uint64_t>(size))
      throw IoError(make_error(ENODATA, path, off,
                               "read past end of file: the file has " + std::to_string(size) +
                                   " bytes, the request needs bytes [" + std::to_string(off) + ", " +
                                   std::to_string(static_cast<uint64_t>(off) + n) + ")"));
  }
  if (n == 0) return;

  const size_t piece = std::max(round_down(opts_.block_size, align), align);
  const uint64_t start = static_cast<uint64_t>(off), end = start + n;
  uint64_t mid_lo = std::min<uint64_t>(end, round_up(start, align));
  uint64_t mid_hi = std::max<uint64_t>(mid_lo, round_down(end, align));

  auto add = [&](uint64_t lo, uint64_t hi, int fd, size_t a) {
    for (uint64_t x = lo; x < hi; x += piece) {
      Chunk c;
      c.req = &req;
      c.fd = fd;
      c.off = static_cast<int64_t>(x);
      c.len = static_cast<size_t>(std::min<uint64_t>(piece, hi - x));
      c.write = req.write_;
      c.align = a;
      char* user = buf + (x - start);
      if (a > 1 && reinterpret_cast<uintptr_t>(user) % a != 0)
        c.user = user;  // bounce: a worker attaches an aligned buffer
      else
        c.buf = user;
      req.chunks_.push_back(c);
    }
  };

  if (!opts_.direct) {
    add(start, end, fd_main, 1);
    return;
  }
  int fd_buffered = -1;
  if (start < mid_lo || mid_hi < end) {
    req.file_buffered_ = open_or_throw(false);
    fd_buffered = req.file_buffered_->fd;
  }
  if (start < mid_lo) add(start, mid_lo, fd_buffered, 1);
  add(mid_lo, mid_hi, fd_main, align);
  if (mid_hi < end) add(mid_hi, end, fd_buffered, 1);
}

// The data flow of one worker: gather -> prepare -> submit -> reap -> settle
// (finish, fail or retry), until the handle stops.
void Handle::worker_loop(Worker* w) {
  while (w->gather()) {
    w->prepare();
    w->submit_batch();
    if (w->inflight > 0)
      w->reap();
    else
      w->wait_before_retry();
  }
  // Tear the engine down here so that workers do it in parallel:
  // io_destroy waits for an RCU grace period (tens of ms) each.
  w->engine.reset();
}

}  // namespace infinity::io
