#include "engine.hpp"

#include <cerrno>

namespace infinity::io {

std::unique_ptr<Engine> make_threads_engine();
std::unique_ptr<Engine> make_libaio_engine(int depth, int* err);
std::unique_ptr<Engine> make_uring_engine(int depth, int* err);

// Builds without a backend's headers get a factory that says so.
#ifndef INFINITY_HAVE_LIBAIO
std::unique_ptr<Engine> make_libaio_engine(int, int* err) {
  *err = ENOSYS;
  return nullptr;
}
#endif
#ifndef INFINITY_HAVE_URING
std::unique_ptr<Engine> make_uring_engine(int, int* err) {
  *err = ENOSYS;
  return nullptr;
}
#endif

std::unique_ptr<Engine> make_engine(Backend backend, int queue_depth, int* err) {
  *err = 0;
  switch (backend) {
    case Backend::kLibaio: return make_libaio_engine(queue_depth, err);
    case Backend::kIoUring: return make_uring_engine(queue_depth, err);
    case Backend::kThreads: return make_threads_engine();
  }
  *err = 22;
  return nullptr;
}

bool backend_compiled(Backend backend) {
  switch (backend) {
#ifdef INFINITY_HAVE_LIBAIO
    case Backend::kLibaio: return true;
#endif
#ifdef INFINITY_HAVE_URING
    case Backend::kIoUring: return true;
#endif
    case Backend::kThreads: return true;
    default: return false;
  }
}

const char* backend_name(Backend backend) {
  switch (backend) {
    case Backend::kLibaio: return "libaio";
    case Backend::kIoUring: return "io_uring";
    case Backend::kThreads: return "threads";
  }
  return "?";
}

bool parse_backend(const std::string& name, Backend* out) {
  for (Backend b : {Backend::kLibaio, Backend::kIoUring, Backend::kThreads}) {
    if (name == backend_name(b)) {
      *out = b;
      return true;
    }
  }
  return false;
}

}  // namespace infinity::io
