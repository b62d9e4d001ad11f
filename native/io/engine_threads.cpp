// The portable engine: blocking pread/pwrite on the worker thread itself.
// Concurrency comes from the number of workers (AsyncIO threads=...), the
// way fio's psync engine scales with numjobs.
#include <unistd.h>

#include <cerrno>
#include <vector>

#include "engine.hpp"

namespace infinity::io {
namespace {

class ThreadsEngine final : public Engine {
 public:
  int capacity() const override { return 1; }

  int submit(Chunk* const* chunks, int n) override {
    for (int i = 0; i < n; ++i) {
      Chunk* c = chunks[i];
      ssize_t r = c->write ? ::pwrite(c->fd, c->cur_buf(), c->remaining(), c->cur_off())
                           : ::pread(c->fd, c->cur_buf(), c->remaining(), c->cur_off());
      done_.push_back({c, r < 0 ? -static_cast<int64_t>(errno) : static_cast<int64_t>(r)});
    }
    return n;
  }

  int reap(Completion* out, int max, int /*timeout_ms*/) override {
    int n = 0;
    while (n < max && !done_.empty()) {
      out[n++] = done_.back();
      done_.pop_back();
    }
    return n;
  }

 private:
  std::vector<Completion> done_;
};

}  // namespace

std::unique_ptr<Engine> make_threads_engine() { return std::make_unique<ThreadsEngine>(); }

}  // namespace infinity::io
