// Linux native AIO. Only truly asynchronous with O_DIRECT; on a buffered fd
// io_submit blocks, which is still correct.
#include "engine.hpp"

#ifdef INFINITY_HAVE_LIBAIO
#include <libaio.h>

#include <cerrno>
#include <ctime>
#include <vector>

namespace infinity::io {
namespace {

class LibaioEngine final : public Engine {
 public:
  explicit LibaioEngine(int depth) : depth_(depth), iocbs_(depth), ptrs_(depth), events_(depth) {
    for (int i = depth - 1; i >= 0; --i) free_.push_back(i);
  }
  ~LibaioEngine() override {
    if (ctx_) io_destroy(ctx_);
  }

  int init() { return io_setup(depth_, &ctx_); }  // returns -errno
  int capacity() const override { return depth_; }

  int submit(Chunk* const* chunks, int n) override {
    // iocbs are reused: slot i is free once its chunk has been reaped, and
    // the worker never has more than capacity() chunks out.
    for (int i = 0; i < n; ++i) {
      Chunk* c = chunks[i];
      iocb* cb = &iocbs_[next_slot()];
      if (c->write)
        io_prep_pwrite(cb, c->fd, c->cur_buf(), c->remaining(), c->cur_off());
      else
        io_prep_pread(cb, c->fd, c->cur_buf(), c->remaining(), c->cur_off());
      cb->data = c;
      ptrs_[i] = cb;
    }
    int r = io_submit(ctx_, n, ptrs_.data());
    // Slots of iocbs that were not accepted go back to the free list.
    int accepted = r < 0 ? 0 : r;
    for (int i = accepted; i < n; ++i) release_slot(ptrs_[i]);
    return r;
  }

  int reap(Completion* out, int max, int timeout_ms) override {
    timespec ts{timeout_ms / 1000, (timeout_ms % 1000) * 1000000L};
    int r = io_getevents(ctx_, 1, max < depth_ ? max : depth_, events_.data(), &ts);
    if (r < 0) return r;
    for (int i = 0; i < r; ++i) {
      iocb* cb = events_[i].obj;
      // res is unsigned long in the ABI; a negative errno arrives as a huge
      // value, so reinterpret it as signed.
      out[i] = {static_cast<Chunk*>(events_[i].data), static_cast<int64_t>(static_cast<long>(events_[i].res))};
      release_slot(cb);
    }
    return r;
  }

 private:
  // Never empty here: the worker keeps at most capacity() chunks out.
  int next_slot() {
    int s = free_.back();
    free_.pop_back();
    return s;
  }
  void release_slot(iocb* cb) { free_.push_back(static_cast<int>(cb - iocbs_.data())); }

  int depth_;
  io_context_t ctx_ = nullptr;
  std::vector<iocb> iocbs_;
  std::vector<iocb*> ptrs_;
  std::vector<io_event> events_;
  std::vector<int> free_;
};

}  // namespace

std::unique_ptr<Engine> make_libaio_engine(int depth, int* err) { return start_engine<LibaioEngine>(depth, err); }

}  // namespace infinity::io

#endif  // the stub for builds without libaio.h is in engine.cpp
