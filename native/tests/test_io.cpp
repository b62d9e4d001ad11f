// Native I/O tests without Python, so they run cleanly under ASan/UBSan and
// LeakSanitizer (`make asan` from the project root).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <thread>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "check.hpp"
#include "cpu/crc32c.hpp"
#include "io/engine.hpp"
#include "io/fault.hpp"
#include "io/file.hpp"
#include "io/handle.hpp"

using namespace infinity::io;

static std::string g_dir;

static std::vector<char> random_bytes(size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<char> v(n);
  for (auto& c : v) c = static_cast<char>(rng());
  return v;
}

static HandleOptions opts(Backend b, size_t block = 64 << 10, int qd = 8, int threads = 2) {
  HandleOptions o;
  o.backend = b;
  o.block_size = block;
  o.queue_depth = qd;
  o.threads = threads;
  o.direct = true;
  return o;
}

static void round_trips(Backend b) {
  Handle h(opts(b));
  const std::string path = g_dir + "/rt.bin";
  for (size_t n : {0ul, 1ul, 4095ul, 4096ul, 4097ul, (1ul << 20) - 1, (1ul << 20) + 1, (8ul << 20) + 123}) {
    for (int64_t off : {0l, 1l, 4096l, 5000l}) {
      for (size_t shift : {0ul, 3ul}) {
        ::unlink(path.c_str());
        std::vector<char> src = random_bytes(n + shift, static_cast<unsigned>(n + off));
        std::vector<char> dst(n + 7, 0);
        auto w = h.submit(true, src.data() + shift, n, path, off);
        w->wait(-1);
        CHECK(w->result() == n);
        // Every other read has the worker take its checksum (see [Note: checksum on completion]).
        const bool sum = (n + off + shift) % 2 == 0;
        auto r = h.submit(false, dst.data() + 7, n, path, off, sum);
        r->wait(-1);
        CHECK(r->result() == n);
        CHECK(n == 0 || std::memcmp(src.data() + shift, dst.data() + 7, n) == 0);
        if (sum) CHECK(r->crc32c() == infinity::cpu::crc32c(src.data() + shift, n));
      }
    }
  }
}

// single_submit and overlap_events change how chunks reach the kernel, never the bytes.
static void submit_modes(Backend b) {
  const std::string path = g_dir + "/modes.bin";
  const size_t n = (4ul << 20) + 4321;
  for (bool single : {false, true}) {
    for (bool overlap : {false, true}) {
      HandleOptions o = opts(b, 64 << 10, 4, 1);
      o.single_submit = single;
      o.overlap_events = overlap;
      Handle h(o);
      std::vector<char> src = random_bytes(n, single * 2 + overlap);
      std::vector<char> dst(n, 0);
      auto w = h.submit(true, src.data(), n, path, 0);
      w->wait(-1);
      CHECK(w->result() == n);
      auto r = h.submit(false, dst.data(), n, path, 0);
      r->wait(-1);
      CHECK(r->result() == n);
      CHECK(std::memcmp(src.data(), dst.data(), n) == 0);
      // 4 MiB in 64 KiB pieces: at least 64 chunks each way.
      CHECK(!single || h.submit_calls() >= 128);
    }
  }
}

static void errors(Backend b) {
  Handle h(opts(b));
  char buf[16];
  try {
    h.submit(false, buf, sizeof buf, g_dir + "/missing.bin", 3);
    CHECK(false);
  } catch (const IoError& e) {
    CHECK(e.info().err == ENOENT && e.info().offset == 3 && e.info().path == g_dir + "/missing.bin");
  }
  const std::string path = g_dir + "/small.bin";
  auto w = h.submit(true, buf, sizeof buf, path, 0);
  w->wait(-1);
  try {
    h.submit(false, buf, sizeof buf, path, 8);
    CHECK(false);
  } catch (const IoError& e) {
    CHECK(e.info().err == ENODATA);
  }
  try {
    h.submit(false, buf, sizeof buf, path, -1);
    CHECK(false);
  } catch (const ArgumentError&) {
  }
  // A NUL in the path is refused: open() would use the path cut at it and write to another file.
  const std::string cut = g_dir + "/nul";
  try {
    h.submit(true, buf, sizeof buf, cut + std::string(1, '\0') + "b", 0);
    CHECK(false);
  } catch (const ArgumentError&) {
  }
  CHECK(::access(cut.c_str(), F_OK) != 0);
  // Injected EIO fails one request; a concurrent one still completes.
  std::vector<char> big = random_bytes(1 << 20, 1), other(1 << 20);
  arm_fault(3, FaultMode::kErrno, EIO);
  auto a = h.submit(true, big.data(), big.size(), g_dir + "/a.bin", 0);
  auto c = h.submit(true, other.data(), other.size(), g_dir + "/c.bin", 0);
  a->wait(-1);
  c->wait(-1);
  int failed = 0;
  for (auto* r : {a.get(), c.get()}) {
    try {
      r->result();
    } catch (const IoError& e) {
      CHECK(e.info().err == EIO);
      ++failed;
    }
  }
  CHECK(failed == 1);
  // A checksum is a read's; asking a request that did not want one, or a failed read, for it throws.
  try {
    h.submit(true, buf, sizeof buf, path, 0, true);
    CHECK(false);
  } catch (const ArgumentError&) {
  }
  try {
    a->crc32c();
    CHECK(false);
  } catch (const ArgumentError&) {
  }
  arm_fault(1, FaultMode::kErrno, EIO);
  auto bad = h.submit(false, big.data(), big.size(), g_dir + "/c.bin", 0, true);
  bad->wait(-1);
  try {
    bad->crc32c();
    CHECK(false);
  } catch (const IoError& e) {
    CHECK(e.info().err == EIO);
  }
  disarm_fault();
  // Injected short read is resubmitted, not reported as done.
  std::vector<char> back(big.size());
  auto w2 = h.submit(true, big.data(), big.size(), g_dir + "/a.bin", 0);
  w2->wait(-1);
  w2->result();
  arm_fault(2, FaultMode::kShort, 0);
  auto r2 = h.submit(false, back.data(), back.size(), g_dir + "/a.bin", 0);
  r2->wait(-1);
  CHECK(r2->result() == big.size());
  CHECK(std::memcmp(back.data(), big.data(), big.size()) == 0);
  disarm_fault();
}

static void many_in_flight(Backend b) {
  Handle h(opts(b, 16 << 10, 4, 2));
  const std::string path = g_dir + "/many.bin";
  std::mt19937 rng(7);
  std::vector<std::vector<char>> bufs;
  std::vector<std::shared_ptr<Request>> reqs;
  for (int i = 0; i < 300; ++i) {
    size_t n = rng() % 20000;
    bufs.push_back(random_bytes(n + 1, i));
    reqs.push_back(h.submit(true, bufs.back().data() + 1, n, path, static_cast<int64_t>(i) * 20000));
  }
  h.wait_all();
  for (size_t i = 0; i < reqs.size(); ++i) {
    CHECK(reqs[i]->done());
    CHECK(reqs[i]->result() == bufs[i].size() - 1);
  }
  for (size_t i = 0; i < bufs.size(); ++i) {
    std::vector<char> back(bufs[i].size() - 1);
    auto r = h.submit(false, back.data(), back.size(), path, static_cast<int64_t>(i) * 20000);
    r->wait(-1);
    r->result();
    CHECK(back.empty() || std::memcmp(back.data(), bufs[i].data() + 1, back.size()) == 0);
  }
}

// close() racing with submit(): each submission is refused or completes.
static void close_race(Backend b) {
  for (int round = 0; round < 5; ++round) {
    Handle h(opts(b, 4096, 2, 2));
    std::vector<char> buf(5000, 7);
    std::vector<std::shared_ptr<Request>> done;
    std::atomic<int> submitted{0};
    std::thread t([&] {
      for (int i = 0; i < 200; ++i) {
        try {
          done.push_back(h.submit(true, buf.data(), buf.size(), g_dir + "/race.bin", i * 5000));
          ++submitted;
        } catch (const ArgumentError&) {
          return;
        }
      }
    });
    while (submitted.load() < 5) std::this_thread::yield();
    h.close();
    t.join();
    for (auto& r : done) {
      CHECK(r->done());
      CHECK(r->result() == buf.size());
    }
  }
}

static void lifetimes(Backend b) {
  char buf[100] = {1};
  for (int i = 0; i < 30; ++i) {
    Handle h(opts(b, 4096, 2, 2));
    auto w = h.submit(true, buf, sizeof buf, g_dir + "/life.bin", 0);  // dropped before done, on purpose
  }
}

static int open_fds() {
  int n = 0;
  for (int fd = 0; fd < 4096; ++fd) n += ::fcntl(fd, F_GETFD) != -1;
  return n;
}

// [Note: cached file descriptors]: one open per file, bounded, right after a replace, all closed at close().
static void fd_cache(Backend b) {
  const int fds_before = open_fds();
  {
    HandleOptions o = opts(b);
    o.fd_cache = 4;
    Handle h(o);
    const std::string path = g_dir + "/cached.bin";
    std::vector<char> a = random_bytes(1 << 16, 1), got(1 << 16);
    for (int i = 0; i < 10; ++i) {
      auto w = h.submit(true, a.data(), a.size(), path, 0);
      w->wait(-1);
      CHECK(w->result() == a.size());
      auto r = h.submit(false, got.data(), got.size(), path, 0);
      r->wait(-1);
      CHECK(r->result() == got.size());
    }
    CHECK(h.files_opened() == 2);  // one write fd, one read fd, for 20 requests
    CHECK(std::memcmp(a.data(), got.data(), a.size()) == 0);
    // Replaced by a rename, as a swap file rewritten elsewhere would be: the new bytes are read.
    std::vector<char> c = random_bytes(1 << 16, 2);
    const std::string other = g_dir + "/cached.new";
    int fd = ::open(other.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    CHECK(fd >= 0 && ::write(fd, c.data(), c.size()) == static_cast<ssize_t>(c.size()) && ::close(fd) == 0);
    CHECK(::rename(other.c_str(), path.c_str()) == 0);
    auto r = h.submit(false, got.data(), got.size(), path, 0);
    r->wait(-1);
    CHECK(r->result() == got.size() && std::memcmp(c.data(), got.data(), c.size()) == 0);
    // Removed and written again: the write goes to the new file, not the unlinked inode.
    CHECK(::unlink(path.c_str()) == 0);
    auto w = h.submit(true, a.data(), a.size(), path, 0);
    w->wait(-1);
    CHECK(w->result() == a.size());
    struct stat st;
    CHECK(::stat(path.c_str(), &st) == 0 && st.st_size == static_cast<off_t>(a.size()));
    // Removed by someone else, and never written again: the next open (a miss) drops its cached fds, so the
    // blocks are freed while the handle lives ([Note: cached fds never keep a deleted file]).
    const size_t cached = h.fds_cached();
    CHECK(::unlink(path.c_str()) == 0);
    auto y = h.submit(true, a.data(), 4096, g_dir + "/after-unlink", 0);
    y->wait(-1);
    CHECK(y->result() == 4096);
    CHECK(h.fds_cached() <= cached);  // the new file's fd in, the removed file's (its write fd, and a read fd of an
                                      // inode unlinked earlier) out: without the sweep, cached + 1
    // Bounded: 12 files through a cache of 4.
    for (int i = 0; i < 12; ++i) {
      auto x = h.submit(true, a.data(), 4096, g_dir + "/many" + std::to_string(i), 0);
      x->wait(-1);
      CHECK(x->result() == 4096);
    }
    CHECK(h.fds_cached() <= 4);
    CHECK(open_fds() <= fds_before + 4 + 2 * o.threads + 8);  // the cache plus the engines' own fds
    h.close();
    CHECK(h.fds_cached() == 0);
  }
  CHECK(open_fds() == fds_before);  // nothing leaked
  // fd_cache = 0: every request opens (and closes) its own.
  HandleOptions o = opts(b);
  o.fd_cache = 0;
  Handle h(o);
  std::vector<char> a = random_bytes(4096, 3);
  for (int i = 0; i < 3; ++i) {
    auto w = h.submit(true, a.data(), a.size(), g_dir + "/uncached.bin", 0);
    w->wait(-1);
    CHECK(w->result() == a.size());
  }
  CHECK(h.files_opened() == 3 && h.fds_cached() == 0);
}

int main() {
  char tmpl[] = "/var/tmp/infinity-native-test.XXXXXX";
  const char* dir = ::mkdtemp(tmpl);
  if (!dir) {
    std::perror("mkdtemp");
    return 2;
  }
  g_dir = dir;
  for (Backend b : {Backend::kLibaio, Backend::kIoUring, Backend::kThreads}) {
    if (!backend_compiled(b)) {
      std::printf("skip %s: not compiled in\n", backend_name(b));
      continue;
    }
    int err = 0;
    if (!make_engine(b, 4, &err)) {
      std::printf("skip %s: cannot start here (%s)\n", backend_name(b), std::strerror(err));
      continue;
    }
    int before = g_failures;
    round_trips(b);
    submit_modes(b);
    errors(b);
    many_in_flight(b);
    lifetimes(b);
    close_race(b);
    fd_cache(b);
    std::printf("%s: %s\n", backend_name(b), g_failures == before ? "ok" : "FAILED");
  }
  std::string cmd = "rm -rf '" + g_dir + "'";
  if (std::system(cmd.c_str()) != 0) std::fprintf(stderr, "could not remove %s\n", g_dir.c_str());
  std::printf("%s\n", g_failures ? "native tests FAILED" : "native tests passed");
  return g_failures ? 1 : 0;
}
