#include "parallel.hpp"

#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

namespace infinity::cpu {
namespace {

class Pool {
 public:
  void run(int ntasks, const std::function<void(int)>& fn) {
    std::lock_guard<std::mutex> serial(run_mu_);
    ensure(ntasks - 1);
    {
      std::lock_guard<std::mutex> lk(mu_);
      job_ = &fn;
      ntasks_ = ntasks;
      next_ = 1;
      remaining_ = ntasks - 1;
      ++generation_;
    }
    cv_.notify_all();
    fn(0);
    std::unique_lock<std::mutex> lk(mu_);
    done_cv_.wait(lk, [&] { return remaining_ == 0; });
    job_ = nullptr;
  }

 private:
  // Starts helpers up to `want`. After fork() the child has none of the
  // parent's threads: forget them (they cannot be joined) and start afresh.
  void ensure(int want) {
    if (pid_ != ::getpid()) {
      for (auto& t : threads_) t.detach();
      threads_.clear();
      pid_ = ::getpid();
    }
    while (static_cast<int>(threads_.size()) < want) threads_.emplace_back([this] { loop(); });
  }

  void loop() {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      cv_.wait(lk, [&] { return generation_ != seen && next_ < ntasks_; });
      seen = generation_;
      while (next_ < ntasks_) {
        int task = next_++;
        const std::function<void(int)>* job = job_;
        lk.unlock();
        (*job)(task);
        lk.lock();
        if (--remaining_ == 0) done_cv_.notify_all();
      }
    }
  }

  std::mutex run_mu_;
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  std::vector<std::thread> threads_;
  const std::function<void(int)>* job_ = nullptr;
  int ntasks_ = 0, next_ = 0, remaining_ = 0;
  uint64_t generation_ = 0;
  pid_t pid_ = ::getpid();
};

// Leaked on purpose: helpers block in loop() forever, and joining them at
// static destruction would hang interpreter shutdown.
Pool& pool() {
  static Pool* p = new Pool();
  return *p;
}

int g_threads = 0;  // 0 = all cores

}  // namespace

int num_threads() {
  if (g_threads > 0) return g_threads;
  unsigned hw = std::thread::hardware_concurrency();
  return hw ? static_cast<int>(hw) : 1;
}

void set_num_threads(int n) { g_threads = n < 1 ? 0 : n; }

void parallel_run(int ntasks, const std::function<void(int)>& fn) {
  if (ntasks <= 1) {
    if (ntasks == 1) fn(0);
    return;
  }
  pool().run(ntasks, fn);
}

void parallel_for(size_t n, size_t align, size_t min_per_thread, const std::function<void(size_t, size_t)>& fn) {
  if (n == 0) return;
  size_t parts = std::min<size_t>(static_cast<size_t>(num_threads()), std::max<size_t>(1, n / min_per_thread));
  size_t per = (n + parts - 1) / parts;
  per = (per + align - 1) / align * align;
  parts = (n + per - 1) / per;
  parallel_run(static_cast<int>(parts), [&](int t) {
    size_t lo = static_cast<size_t>(t) * per;
    size_t hi = std::min(n, lo + per);
    if (lo < hi) fn(lo, hi);
  });
}

}  // namespace infinity::cpu
