// The API layer of native I/O: a Handle owns worker threads (each with its
// own Engine) and turns a user request into block-sized Chunks; a Request is
// the shared state behind one returned future.
//
// [Note: request lifetime]
// A Request is held by the caller's future and, while any of its chunks is
// unfinished, by itself (`self_`). The worker that finishes the last chunk
// lets go of its fds, marks it done, tells the Handle, and only then drops
// `self_`; it touches neither the Request nor its Chunks afterwards. The
// caller must keep the user buffer alive until the Request is done; the
// Python layer does so by holding the buffer in the future.
//
// [Note: checksum on completion]
// A read submitted with checksum=true has the CRC-32C of its bytes taken by
// the worker that finishes its last chunk, in complete(), before the request
// is marked done (the buffer is still the caller's to keep alive then, and
// every chunk, bounce copies included, has landed in it). The caller compares
// that number with the one it expects, so a verified read costs its waiting
// thread nothing: for the engine, the step thread that needs the shard.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine.hpp"
#include "fd_cache.hpp"
#include "io_error.hpp"

namespace infinity::io {

class Handle;

struct HandleOptions {
  Backend backend = Backend::kThreads;
  size_t block_size = 1 << 20;  // largest piece handed to the kernel at once (<= 1 GiB)
  int queue_depth = 32;         // pieces in flight per worker
  int threads = 1;              // workers, each with its own engine
  bool direct = true;           // O_DIRECT for the aligned bulk of a request
  // DeepSpeed's two aio switches, with the same meaning:
  bool single_submit = false;   // one chunk per submit syscall instead of a batch
  bool overlap_events = true;   // refill the queue as chunks complete; false: submit a batch,
                                // wait for all of it, then submit the next
  size_t fd_cache = 1024;       // open fds kept per handle (see [Note: cached file descriptors]); 0: none
};

class Request {
 public:
  Request(Handle* handle, bool write, std::string path, int64_t offset, size_t nbytes);
  ~Request();

  // Blocks until done or until timeout_s passes (negative = forever).
  // Returns true when done.
  bool wait(double timeout_s);
  bool done();
  // Bytes moved; throws IoError if the request failed. Call after wait().
  size_t result();
  // The CRC-32C of the bytes a read brought in, taken by the worker that finished it (see [Note: checksum
  // on completion]); throws IoError if the read failed, ArgumentError if it was not asked for or is not done.
  uint32_t crc32c();

  bool is_write() const { return write_; }
  const std::string& path() const { return path_; }
  int64_t offset() const { return offset_; }
  size_t nbytes() const { return nbytes_; }

 private:
  friend class Handle;
  void chunk_finished(const ErrorInfo* err);
  void complete();

  Handle* handle_;
  bool write_;
  std::string path_;
  int64_t offset_;
  size_t nbytes_;

  std::vector<Chunk> chunks_;
  std::shared_ptr<OpenFile> file_direct_;    // the chunks' fds stay open while these are held
  std::shared_ptr<OpenFile> file_buffered_;
  std::atomic<size_t> unfinished_{0};
  std::atomic<bool> failed_{false};
  std::shared_ptr<Request> self_;  // see [Note: request lifetime]
  char* buf_ = nullptr;      // the user's memory (read by complete() when checksum_)
  bool checksum_ = false;    // a read whose CRC-32C complete() takes
  uint32_t crc_ = 0;

  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  ErrorInfo error_;
};

class Handle {
 public:
  explicit Handle(const HandleOptions& opts);  // throws IoError if an engine cannot start
  ~Handle();
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;

  // Starts a read into / write from [buf, buf+nbytes) at `offset` of `path`.
  // Argument and open errors throw here; I/O errors surface from the Request.
  // checksum (reads only): the finishing worker takes the CRC-32C of what landed (Request::crc32c).
  std::shared_ptr<Request> submit(bool write, void* buf, size_t nbytes, const std::string& path, int64_t offset,
                                  bool checksum = false);
  void wait_all();
  // Drops the cached fds of `path` (see [Note: cached file descriptors]).
  void forget(const std::string& path) { fds_.forget(path); }
  // Waits for everything in flight, stops the workers and closes the cached
  // fds. Idempotent. Throws IoError if closing a written file's cached fd
  // failed (see [Note: cached file descriptors]).
  void close();
  bool closed() const { return closed_.load(); }

  const HandleOptions& options() const { return opts_; }
  int64_t inflight() const { return inflight_.load(); }
  uint64_t bytes_read() const { return bytes_read_.load(); }
  uint64_t bytes_written() const { return bytes_written_.load(); }
  // Engine submit calls so far (a syscall each for libaio; io_uring_submit for io_uring).
  uint64_t submit_calls() const { return submit_calls_.load(); }
  // Files opened so far (each open is an open(2), an fstat and, with O_DIRECT, a statx) and fds cached now.
  uint64_t files_opened() const { return fds_.opens(); }
  size_t fds_cached() { return fds_.size(); }

 private:
  friend class Request;
  struct Worker;
  void plan(Request& req, char* buf);
  void worker_loop(Worker* w);
  void release_inflight();
  ErrorInfo shutdown();

  HandleOptions opts_;
  std::atomic<bool> closed_{false};
  std::mutex close_mu_;

  std::mutex queue_mu_;
  std::condition_variable queue_cv_;
  std::deque<Chunk*> queue_;
  bool stopping_ = false;
  std::vector<std::unique_ptr<Worker>> workers_;

  std::mutex idle_mu_;
  std::condition_variable idle_cv_;
  std::atomic<int64_t> inflight_{0};
  std::atomic<uint64_t> bytes_read_{0};
  std::atomic<uint64_t> bytes_written_{0};
  std::atomic<uint64_t> submit_calls_{0};
  FdCache fds_;
};

}  // namespace infinity::io
