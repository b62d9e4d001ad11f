// The lowest layer: an Engine moves Chunks between memory and a file
// descriptor. It returns -errno and never throws (see io_error.hpp).
//
// One Engine belongs to one worker thread, so an engine needs no locking.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace infinity::io {

class Request;

enum class Backend { kLibaio, kIoUring, kThreads };

// One kernel-sized piece of a request: at most block_size bytes.
struct Chunk {
  Request* req = nullptr;
  int fd = -1;
  char* buf = nullptr;      // what the kernel reads into / writes from
  char* user = nullptr;     // non-null when buf is a bounce buffer: the user's bytes
  size_t len = 0;
  int64_t off = 0;          // file offset of byte 0 of this chunk
  size_t done = 0;          // bytes already moved; a short transfer resubmits the rest
  size_t align = 1;         // O_DIRECT alignment of fd (1 for buffered fds)
  bool write = false;
  int bounce_slot = -1;     // index of the worker's bounce buffer, -1 if none
  int stalls = 0;           // short transfers that made no net progress

  char* cur_buf() const { return buf + done; }
  int64_t cur_off() const { return off + static_cast<int64_t>(done); }
  size_t remaining() const { return len - done; }
};

struct Completion {
  Chunk* chunk;
  int64_t res;  // bytes moved, or -errno
};

class Engine {
 public:
  virtual ~Engine() = default;
  // How many chunks may be in flight at once.
  virtual int capacity() const = 0;
  // Start chunks. Returns how many were accepted (the rest stay with the
  // caller), or -errno when none could be.
  virtual int submit(Chunk* const* chunks, int n) = 0;
  // Wait up to timeout_ms for at least one completion; returns the count
  // (0 on timeout) or -errno.
  virtual int reap(Completion* out, int max, int timeout_ms) = 0;
};

// Constructs E(depth) and runs its init() (which returns -errno); nullptr
// with *err set to the positive errno when init fails.
template <class E>
std::unique_ptr<Engine> start_engine(int depth, int* err) {
  auto e = std::make_unique<E>(depth);
  int r = e->init();
  if (r < 0) {
    *err = -r;
    return nullptr;
  }
  return e;
}

// Creates an engine or returns nullptr with *err set to a positive errno.
std::unique_ptr<Engine> make_engine(Backend backend, int queue_depth, int* err);

bool backend_compiled(Backend backend);
const char* backend_name(Backend backend);
// Parses "libaio", "io_uring", "threads"; returns false for anything else.
bool parse_backend(const std::string& name, Backend* out);

}  // namespace infinity::io
