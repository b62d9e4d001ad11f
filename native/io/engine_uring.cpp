// io_uring engine: one ring per worker, sized to the queue depth.
#include "engine.hpp"

#ifdef INFINITY_HAVE_URING
#include <liburing.h>

#include <cerrno>

namespace infinity::io {
namespace {

class UringEngine final : public Engine {
 public:
  explicit UringEngine(int depth) : depth_(depth) {}
  ~UringEngine() override {
    if (ready_) io_uring_queue_exit(&ring_);
  }

  int init() {
    int r = io_uring_queue_init(static_cast<unsigned>(depth_), &ring_, 0);
    ready_ = r == 0;
    return r;
  }
  int capacity() const override { return depth_; }

  int submit(Chunk* const* chunks, int n) override {
    int queued = 0;
    for (; queued < n; ++queued) {
      io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
      if (!sqe) break;  // ring full: the caller keeps the rest
      Chunk* c = chunks[queued];
      if (c->write)
        io_uring_prep_write(sqe, c->fd, c->cur_buf(), static_cast<unsigned>(c->remaining()), c->cur_off());
      else
        io_uring_prep_read(sqe, c->fd, c->cur_buf(), static_cast<unsigned>(c->remaining()), c->cur_off());
      io_uring_sqe_set_data(sqe, c);
    }
    if (queued == 0) return -EAGAIN;
    // SQEs the kernel did not take (an error, or a partial submit) stay in
    // the ring, so every queued chunk counts as accepted; reap() pushes out
    // whatever is still waiting before it sleeps.
    io_uring_submit(&ring_);
    return queued;
  }

  int reap(Completion* out, int max, int timeout_ms) override {
    if (io_uring_sq_ready(&ring_) > 0) io_uring_submit(&ring_);
    io_uring_cqe* cqe = nullptr;
    __kernel_timespec ts{timeout_ms / 1000, (timeout_ms % 1000) * 1000000LL};
    int r = io_uring_wait_cqe_timeout(&ring_, &cqe, &ts);
    if (r == -ETIME) return 0;
    if (r < 0) return r;
    int n = 0;
    while (n < max && io_uring_peek_cqe(&ring_, &cqe) == 0 && cqe) {
      out[n++] = {static_cast<Chunk*>(io_uring_cqe_get_data(cqe)), static_cast<int64_t>(cqe->res)};
      io_uring_cqe_seen(&ring_, cqe);
    }
    return n;
  }

 private:
  int depth_;
  bool ready_ = false;
  io_uring ring_{};
};

}  // namespace

std::unique_ptr<Engine> make_uring_engine(int depth, int* err) { return start_engine<UringEngine>(depth, err); }

}  // namespace infinity::io

#endif  // the stub for builds without liburing.h is in engine.cpp
